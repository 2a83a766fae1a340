"""``ForwardingTier``: a ``ChunkTier`` that hands every call to an inner tier -- the base of the test
wrappers (``FaultyTier``, ``SeamTier``), which override only the calls they intercept.

Every method of the contract is forwarded as is, the optional ones included (``snapshot_keys``,
``sequence``, ``subscribe_removals``, ``flush``, ``check``, ``degraded``, ``capacity_bytes``,
``closed``): the base class's defaults would otherwise answer for the inner tier ("no removals",
"never degraded"). ``start_put`` is not forwarded: the base's default runs this wrapper's
``put_many`` after the gate, so what a wrapper intercepts applies to a chain's write-behind too.
Runs on the caller's event loop; cancellation and buffers are the inner tier's rules.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from kvtier.tiers.base import ChunkMeta, ChunkTier, GetItem, KeySnapshot, PutItem, RemovalCallback, TierStatistics

__all__ = ["ForwardingTier"]


class ForwardingTier(ChunkTier):
    """Forwards the whole ``ChunkTier`` contract to ``inner``."""

    def __init__(self, inner: ChunkTier, *, prefix: str = "wrapped") -> None:
        self.inner = inner
        self.name = f"{prefix}-{inner.name}"

    async def put_many(self, items: Sequence[PutItem]) -> int:
        return await self.inner.put_many(items)

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        return await self.inner.get_many_into(items)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        return await self.inner.delete_many(keys)

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        return await self.inner.contains_many(keys)

    async def list_keys(self) -> List[bytes]:
        return await self.inner.list_keys()

    async def snapshot_keys(self) -> KeySnapshot:
        return await self.inner.snapshot_keys()

    @property
    def sequence(self) -> int:
        return self.inner.sequence

    def subscribe_removals(self, callback: RemovalCallback) -> None:
        self.inner.subscribe_removals(callback)

    async def flush(self) -> None:
        await self.inner.flush()

    def touch_many(self, keys: Sequence[bytes]) -> None:
        self.inner.touch_many(keys)

    async def check(self) -> List[str]:
        return await self.inner.check()

    @property
    def degraded(self) -> bool:
        return self.inner.degraded

    @property
    def capacity_bytes(self) -> Optional[int]:
        return self.inner.capacity_bytes

    @property
    def closed(self) -> bool:
        return self.inner.closed

    async def close(self) -> None:
        await self.inner.close()

    def statistics(self) -> TierStatistics:
        return self.inner.statistics()
