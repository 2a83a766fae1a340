"""The contract every byte-holding tier below the host pool keeps (LMDB disk, file-per-chunk, remote).

Primitives: ``ChunkMeta`` (what a record says about its chunk), ``ChunkTier`` (the async facade the
engine drives), ``IOHook`` (the fault-injection point under a tier's low-level operations). Methods are called from the event-loop thread; implementations do their blocking
work on their own threads and hand results back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["ChunkMeta", "ChunkTier", "PutItem", "GetItem", "IOHook"]


@dataclass(frozen=True)
class ChunkMeta:
    """What a record binds besides its bytes: checked on every read, so a record written for another
    model layout, group or chunk is never returned for this one.

    ``dtype`` is the torch dtype name without the ``torch.`` prefix (``"bfloat16"``); ``shape`` is the
    logical shape of the chunk's bytes as the device view lays them out.
    """

    fingerprint: bytes
    group_index: int
    chunk_index: int
    dtype: str
    shape: Tuple[int, ...]


class IOHook:
    """Called by a tier right before each of its low-level operations; the default does nothing.

    The LMDB tier names its operations ``"put"`` (one record into a write transaction), ``"commit"``
    and ``"read"`` (a read transaction); the file tier ``"mkdir"``, ``"open"``, ``"write"``,
    ``"fsync"``, ``"rename"``, ``"fsync_dir"``, ``"read"`` and ``"remove"``. ``before(op)`` runs on
    whichever thread is about to do the operation (the event loop, an I/O thread, the LMDB writer).
    An exception raised there is, to the tier, that operation failing: the fault suite installs a
    hook that raises the error the real call would raise (``kvtier.tools.faults.inject_io_faults``).
    """

    __slots__ = ()

    def before(self, op: str) -> None:
        return None


NO_IO_HOOK = IOHook()


# (key, meta, raw bytes of the chunk): the tier encodes and writes; the caller keeps the buffer alive
# and unchanged until the put returns (the engine pins the host slot).
PutItem = Tuple[bytes, ChunkMeta, memoryview]
# (key, writable buffer of exactly the chunk's raw size): the tier decodes straight into it.
GetItem = Tuple[bytes, memoryview]


class ChunkTier(abc.ABC):
    """An async store of encoded chunk records keyed by 32-byte chunk keys.

    Errors: ``TierFullError`` (no room), ``TierIOError`` (broken underneath), ``ClosedError``.
    A corrupt record is never an error to the reader: it is a miss, quarantined and counted.
    """

    name: str = "tier"

    @abc.abstractmethod
    async def put_many(self, items: Sequence[PutItem]) -> None:
        """Store a batch; durable when it returns. All or nothing: on error no item is visible.

        Cancelling the caller does not stop a batch already handed to the writer; it may still land.
        """

    @abc.abstractmethod
    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Decode each record into its buffer; per item the record's meta, or ``None`` on a miss
        (absent, or corrupt: then quarantined and counted). Buffers of missed items are unspecified.

        Cancelling the caller does not stop reads already running; they finish into the buffers, so
        the caller must keep those buffers reserved until the tier is done (the engine keeps slots
        pinned and discards late results by generation).
        """

    @abc.abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove records; returns how many existed."""

    @abc.abstractmethod
    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Which keys have a record (no checksum check)."""

    @abc.abstractmethod
    async def list_keys(self) -> List[bytes]:
        """Every key currently stored (used to rebuild the engine's index at start)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish queued writes, release resources. Safe to call twice."""

    @abc.abstractmethod
    def statistics(self) -> Dict[str, float]:
        """Counters: records, bytes, puts, gets, misses, corrupt, evictions, errors, degraded..."""
