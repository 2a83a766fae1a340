"""Fault injection for tiers: fail at call N, fail forever, slow down, corrupt stored bytes.

Primitives: ``FaultyTier`` (wraps any ``ChunkTier``), ``InjectedFault`` (the error it raises),
``corrupt_stored_record`` (flips bytes of one record inside an LMDB or file tier). The wrapper runs
on the caller's event loop; it only adds a check and maybe a sleep before delegating.

One level lower, ``IOFaultPlan`` + ``inject_io_faults(tier, plan)`` fail the Nth low-level operation
*inside* an LMDB or file tier (a put or commit of a write transaction, a read transaction; a file
mkdir, open, write, fsync, rename, directory fsync, read or remove), once (``fail_at``) or from then
on (``fail_from``), with the error the real call raises there: ``lmdb.Error`` ("Input/output error")
or ``lmdb.DiskError`` under LMDB, ``OSError(EIO)`` or ``OSError(ENOSPC)`` under files. The plan is
called on the tier's own threads (LMDB writer, I/O pool) as well as the loop, so it counts under a
lock. The tier's own error handling, rollback and statistics are what is then under test.
"""

from __future__ import annotations

import asyncio
import errno as errno_codes
import os
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvtier.errors import InjectedFault
from kvtier.tiers.base import (
    NO_IO_HOOK,
    ChunkMeta,
    ChunkTier,
    GetItem,
    IOHook,
    PutItem,
    TierStatistics,
    check_key,
)

from .forwarding import ForwardingTier

if TYPE_CHECKING:
    from kvtier.tiers.files import FileTier
    from kvtier.tiers.lmdb import LmdbTier

__all__ = [
    "FaultyTier",
    "InjectedFault",
    "corrupt_stored_record",
    "IOFaultPlan",
    "inject_io_faults",
    "remove_io_faults",
    "LMDB_IO_OPS",
    "FILE_IO_OPS",
]

LMDB_IO_OPS = ("put", "commit", "read")
FILE_IO_OPS = ("mkdir", "open", "write", "fsync", "rename", "fsync_dir", "read", "remove")
# The C call py-lmdb names in its message for each operation.
_LMDB_CALLS = {"put": "mdb_put", "commit": "mdb_txn_commit", "read": "mdb_txn_begin"}

_COUNTED_OPS = ("put_many", "get_many_into", "delete_many", "contains_many")


class FaultyTier(ForwardingTier):
    """A ``ChunkTier`` that fails on purpose.

    ``fail_at``: the Nth counted call (1-based, over ``ops``) raises ``InjectedFault`` once.
    ``fail_from``: every counted call from the Nth on raises, until ``heal()``.
    ``delay_s``: every counted call sleeps first (a slow tier; the sleep is cancellable).
    ``corrupt_puts``: after each successful put, the stored bytes of its records are flipped in
    the inner tier, so the next read must detect them.
    """

    def __init__(
        self,
        inner: ChunkTier,
        *,
        fail_at: Optional[int] = None,
        fail_from: Optional[int] = None,
        delay_s: float = 0.0,
        corrupt_puts: bool = False,
        ops: Sequence[str] = _COUNTED_OPS,
    ) -> None:
        unknown = set(ops) - set(_COUNTED_OPS)
        if unknown:
            raise ValueError(f"ops must be among {_COUNTED_OPS}, got {sorted(unknown)}")
        super().__init__(inner, prefix="faulty")
        self.fail_at = fail_at
        self.fail_from = fail_from
        self.delay_s = delay_s
        self.corrupt_puts = corrupt_puts
        self.ops = tuple(ops)
        self.calls = 0
        self.faults = 0
        self.calls_by_op: Dict[str, int] = {op: 0 for op in _COUNTED_OPS}

    def heal(self) -> None:
        """Stop failing and slowing down from now on."""
        self.fail_at = None
        self.fail_from = None
        self.delay_s = 0.0

    async def _enter(self, op: str) -> None:
        self.calls_by_op[op] += 1
        if op not in self.ops:
            return
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.calls == self.fail_at or (self.fail_from is not None and self.calls >= self.fail_from):
            self.faults += 1
            raise InjectedFault(f"injected fault in {op} at call {self.calls}")

    async def put_many(self, items: Sequence[PutItem]) -> int:
        """Delegates after the scripted fault check. Cancelling during the delay stores nothing."""
        for key, _meta, _raw in items:
            check_key(key)
        await self._enter("put_many")
        sequence = await self.inner.put_many(items)
        if self.corrupt_puts:
            for key, _meta, _raw in items:
                await asyncio.get_running_loop().run_in_executor(None, corrupt_stored_record, self.inner, key)
        return sequence

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Delegates after the scripted fault check. Cancelling during the delay reads nothing."""
        for key, _buf in items:
            check_key(key)
        await self._enter("get_many_into")
        return await self.inner.get_many_into(items)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delegates after the scripted fault check."""
        for key in keys:
            check_key(key)
        await self._enter("delete_many")
        return await self.inner.delete_many(keys)

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Delegates after the scripted fault check."""
        for key in keys:
            check_key(key)
        await self._enter("contains_many")
        return await self.inner.contains_many(keys)

    def statistics(self) -> TierStatistics:
        """The inner tier's, with ``injected_faults`` in ``extra``."""
        return self.inner.statistics().with_extra(injected_faults=float(self.faults))

    def __getattr__(self, name: str):
        # Tier-specific extras (path_for, verify, gc, ...) pass through to the inner tier.
        return getattr(self.inner, name)


def corrupt_stored_record(tier: ChunkTier, key: bytes, *, offset_from_end: int = 1) -> None:
    """Flip one byte of the stored record ``key`` (near its end: payload) inside ``tier``.

    Blocking; call from a worker thread. Knows the LMDB tier (rewrites the value in a write
    transaction of its own) and the file tier (rewrites the file in place).
    """
    from kvtier.tiers.files import FileTier
    from kvtier.tiers.lmdb import LmdbTier

    if isinstance(tier, FileTier):
        path = tier.path_for(key)
        with open(path, "r+b") as handle:
            handle.seek(-offset_from_end, os.SEEK_END)
            byte = handle.read(1)
            handle.seek(-offset_from_end, os.SEEK_END)
            handle.write(bytes([byte[0] ^ 0xFF]))
        return
    if isinstance(tier, LmdbTier):
        _corrupt_lmdb_record(tier, bytes(key), offset_from_end)
        return
    raise TypeError(f"cannot corrupt records of {type(tier).__name__}")


def _corrupt_lmdb_record(tier: "LmdbTier", key: bytes, offset_from_end: int) -> None:
    """Rewrite ``key``'s value with one byte flipped, in a write transaction of its own on the
    tier's writer thread (test support: it reaches into the tier's writer side on purpose, so that
    the shipped tier carries no way to damage its own records)."""
    from kvtier.tiers.lmdb.segments import SegmentPointer, is_pointer

    tier._check_usable(write=True)
    assert tier._writer is not None  # not read-only: checked above

    def body(txn: Any) -> Callable[[], None]:
        value = txn.get(key, db=tier._db.tables.chunks)
        if value is None:
            raise KeyError(key.hex())
        if is_pointer(value):  # the record lives in a segment file: flip the byte there
            pointer = SegmentPointer.unpack(value)
            if not 1 <= offset_from_end <= pointer.length:
                raise ValueError(f"offset_from_end must be in 1..{pointer.length}")
            fd = os.open(tier.path / pointer.name, os.O_RDWR)
            try:
                at = pointer.file_offset(pointer.length - offset_from_end)
                byte = os.pread(fd, 1, at)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
            finally:
                os.close(fd)
            return lambda: None
        data = bytearray(value)
        if not 1 <= offset_from_end <= len(data):
            raise ValueError(f"offset_from_end must be in 1..{len(data)}")
        data[-offset_from_end] ^= 0xFF
        txn.put(key, bytes(data), db=tier._db.tables.chunks)
        return lambda: None

    tier._writer.call(lambda: tier._writes.write(body))


class IOFaultPlan(IOHook):
    """Counts a tier's low-level operations and fails the scripted ones (thread-safe).

    ``fail_at``: the Nth counted operation (1-based) fails, once. ``fail_from``: every counted one
    from the Nth on fails, until ``heal()``. ``ops``: which operation names count (default: all the
    tier has). ``errno``: ``EIO`` (an I/O error) or ``ENOSPC`` (a full disk). Bind it to a tier with
    ``inject_io_faults``, which also picks the error type the tier's real calls raise.

    After a run: ``calls`` (counted operations), ``calls_by_op`` (every operation seen, counted or
    not), ``faults`` and ``fault_log`` ((call number, op) of each injected failure).
    """

    def __init__(
        self,
        *,
        fail_at: Optional[int] = None,
        fail_from: Optional[int] = None,
        ops: Optional[Sequence[str]] = None,
        errno: int = errno_codes.EIO,
    ) -> None:
        for name, n in (("fail_at", fail_at), ("fail_from", fail_from)):
            if n is not None and (not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {n!r}")
        if errno not in (errno_codes.EIO, errno_codes.ENOSPC):
            raise ValueError(f"errno must be EIO or ENOSPC, got {errno!r}")
        self.fail_at = fail_at
        self.fail_from = fail_from
        self.ops = None if ops is None else frozenset(ops)
        self.errno = errno
        self.flavour = "os"  # "lmdb" or "os": set by inject_io_faults
        self.calls = 0
        self.faults = 0
        self.calls_by_op: "Counter[str]" = Counter()
        self.fault_log: List[Tuple[int, str]] = []
        self._lock = threading.Lock()

    def heal(self) -> None:
        """Stop failing from now on (operations are still counted)."""
        with self._lock:
            self.fail_at = None
            self.fail_from = None

    def before(self, op: str) -> None:
        with self._lock:
            self.calls_by_op[op] += 1
            if self.ops is not None and op not in self.ops:
                return
            self.calls += 1
            n = self.calls
            fail = n == self.fail_at or (self.fail_from is not None and n >= self.fail_from)
            if fail:
                self.faults += 1
                self.fault_log.append((n, op))
        if fail:
            raise self._error(op, n)

    def _error(self, op: str, n: int) -> BaseException:
        reason = os.strerror(self.errno)
        if self.flavour == "lmdb":
            import lmdb

            # What py-lmdb raises for this errno: DiskError for ENOSPC, the plain Error otherwise.
            cls = lmdb.DiskError if self.errno == errno_codes.ENOSPC else lmdb.Error
            return cls(f"{_LMDB_CALLS.get(op, op)}: {reason} (injected at call {n})")
        return OSError(self.errno, f"{reason} (injected {op} at call {n})")


def _unwrap(tier: ChunkTier) -> ChunkTier:
    while isinstance(tier, FaultyTier):
        tier = tier.inner
    return tier


def _hooked_tier(tier: ChunkTier, doing: str) -> LmdbTier | FileTier:
    """The LMDB or file tier under ``tier`` (a ``FaultyTier`` is looked through): the tiers that
    call an I/O hook. Any other tier is a ``TypeError`` (``doing``: what the caller was doing)."""
    from kvtier.tiers.files import FileTier
    from kvtier.tiers.lmdb import LmdbTier

    inner = _unwrap(tier)
    if not isinstance(inner, (LmdbTier, FileTier)):
        raise TypeError(f"cannot {doing} I/O faults under {type(inner).__name__}")
    return inner


def inject_io_faults(tier: ChunkTier, plan: Optional[IOFaultPlan] = None, **plan_kw) -> IOFaultPlan:
    """Install ``plan`` (or ``IOFaultPlan(**plan_kw)``) under an LMDB or file tier (a ``FaultyTier``
    is looked through) and return it. Replaces any plan installed before."""
    from kvtier.tiers.lmdb import LmdbTier

    if plan is None:
        plan = IOFaultPlan(**plan_kw)
    elif plan_kw:
        raise TypeError("pass a plan or plan arguments, not both")
    inner = _hooked_tier(tier, "inject")
    known: Tuple[str, ...]
    if isinstance(inner, LmdbTier):
        known, plan.flavour = LMDB_IO_OPS, "lmdb"
    else:
        known, plan.flavour = FILE_IO_OPS, "os"
    if plan.ops is not None and not plan.ops <= set(known):
        raise ValueError(f"{type(inner).__name__} has the operations {known}, got {sorted(plan.ops)}")
    inner._io_hook = plan
    return plan


def remove_io_faults(tier: ChunkTier) -> None:
    """Put back the tier's no-op hook (under an LMDB or file tier, as ``inject_io_faults``)."""
    _hooked_tier(tier, "remove")._io_hook = NO_IO_HOOK
