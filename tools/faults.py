"""Fault injection for tiers: fail at call N, fail forever, slow down, corrupt stored bytes.

Primitives: ``FaultyTier`` (wraps any ``ChunkTier``), ``InjectedFault`` (the error it raises),
``corrupt_stored_record`` (flips bytes of one record inside an LMDB or file tier). The wrapper runs
on the caller's event loop; it only adds a check and maybe a sleep before delegating.
"""

from __future__ import annotations

import asyncio
import os
from typing import Dict, List, Optional, Sequence

from kvtier.policy import TierIOError
from kvtier.tiers.base import ChunkMeta, ChunkTier, GetItem, PutItem

__all__ = ["FaultyTier", "InjectedFault", "corrupt_stored_record"]

_COUNTED_OPS = ("put_many", "get_many_into", "delete_many", "contains_many")


class InjectedFault(TierIOError):
    """Raised by ``FaultyTier`` where a fault was scripted; a ``TierIOError`` like a real one."""


class FaultyTier(ChunkTier):
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
        self.inner = inner
        self.name = f"faulty-{getattr(inner, 'name', 'tier')}"
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

    async def put_many(self, items: Sequence[PutItem]) -> None:
        """Delegates after the scripted fault check. Cancelling during the delay stores nothing."""
        await self._enter("put_many")
        await self.inner.put_many(items)
        if self.corrupt_puts:
            for key, _meta, _raw in items:
                await asyncio.get_running_loop().run_in_executor(None, corrupt_stored_record, self.inner, key)

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Delegates after the scripted fault check. Cancelling during the delay reads nothing."""
        await self._enter("get_many_into")
        return await self.inner.get_many_into(items)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delegates after the scripted fault check."""
        await self._enter("delete_many")
        return await self.inner.delete_many(keys)

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Delegates after the scripted fault check."""
        await self._enter("contains_many")
        return await self.inner.contains_many(keys)

    async def list_keys(self) -> List[bytes]:
        return await self.inner.list_keys()

    async def close(self) -> None:
        await self.inner.close()

    def statistics(self) -> Dict[str, float]:
        stats = dict(self.inner.statistics())
        stats["injected_faults"] = self.faults
        return stats

    def __getattr__(self, name: str):
        # Optional tier hooks (subscribe_removals, flush, ...) pass through to the inner tier.
        return getattr(self.inner, name)


def corrupt_stored_record(tier: ChunkTier, key: bytes, *, offset_from_end: int = 1) -> None:
    """Flip one byte of the stored record ``key`` (near its end: payload) inside ``tier``.

    Blocking; call from a worker thread. Knows the LMDB tier (rewrites the value in a write
    transaction of its own) and the file tier (rewrites the file in place).
    """
    from kvtier.tiers.files import FileTier
    from kvtier.tiers.lmdb_tier import LmdbTier

    if isinstance(tier, FileTier):
        path = tier.path_for(key)
        with open(path, "r+b") as handle:
            handle.seek(-offset_from_end, os.SEEK_END)
            byte = handle.read(1)
            handle.seek(-offset_from_end, os.SEEK_END)
            handle.write(bytes([byte[0] ^ 0xFF]))
        return
    if isinstance(tier, LmdbTier):
        tier.corrupt_record_for_tests(key, offset_from_end=offset_from_end)
        return
    raise TypeError(f"cannot corrupt records of {type(tier).__name__}")
