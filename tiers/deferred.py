"""``DeferredTier``: a tier still being opened, that serves misses until it is open.

Primitive: ``DeferredTier(opening, name=...)``, where ``opening`` is a task on the event loop whose
result is the real tier. Event-loop thread, like every tier's async methods; ``statistics`` and the
properties from any thread.

Why: opening a cache directory after an unclean close walks the whole LMDB file with the offline
structure checker before LMDB may map it (``lmdb/recovery.py``: LMDB trusts its pages and can crash
the process on a damaged one), 25 s at 10^6 records. A front end that waited for that would serve
nothing for as long; wrapped in this, it serves from the first second, its disk a miss until the
walk (and, when the walk finds damage, the move aside and the fresh open: the same handling as a
blocking open) is done.

Until the tier is open: a read is a miss (``get_many_into`` answers ``None`` per item,
``contains_many`` ``False``), a recency hint is dropped, ``statistics`` are zeros and ``sequence``
0; every call whose answer needs the tier (``put_many``, ``delete_many``, ``list_keys``,
``snapshot_keys``, ``flush``, ``check``) waits for the open and then forwards. No buffer a caller
passed is touched before the open; a put or delete cancelled while it waits is still handed to the
tier once open, and the call ends only after it (the contract's cancellation and buffer rules).
Removal subscriptions are handed to the tier when it opens. Once open, everything forwards (other
attributes too, e.g. an ``LmdbTier``'s ``path``). An open that failed makes those waiting calls
raise ``TierIOError`` (the failure its cause); reads stay misses. ``close`` waits for the open (its
thread cannot be stopped) and closes the tier it gave.
"""

from __future__ import annotations

import asyncio
from typing import Any, List, Optional, Sequence

from kvtier.errors import ClosedError, KvtierError, TierIOError

from .base import ChunkMeta, ChunkTier, GetItem, KeySnapshot, PutItem, RemovalCallback, StartedPut, TierStatistics, check_key
from .owned_tasks import settle

__all__ = ["DeferredTier"]


class DeferredTier(ChunkTier):
    """A tier given by ``opening`` once it is done (see the module docstring)."""

    def __init__(self, opening: "asyncio.Future[ChunkTier]", *, name: str = "tier") -> None:
        self.name = name
        self._opening = opening
        self._tier: Optional[ChunkTier] = None
        self._subscribers: List[RemovalCallback] = []
        self._closed = False
        opening.add_done_callback(self._opened)

    # -- the open ----------------------------------------------------------------------------------

    def _opened(self, opening: "asyncio.Future[ChunkTier]") -> None:
        if opening.cancelled() or opening.exception() is not None:
            return
        tier = opening.result()
        for callback in self._subscribers:
            tier.subscribe_removals(callback)
        self._tier = tier

    @property
    def opened(self) -> Optional[ChunkTier]:
        """The tier, once open (``None`` before, and after a failed open)."""
        return self._tier

    @property
    def opening(self) -> "asyncio.Future[ChunkTier]":
        """The open in progress (done once the tier is open or the open failed)."""
        return self._opening

    async def _ready(self) -> ChunkTier:
        """The tier, waiting for the open; cancelling the wait leaves the open running."""
        if self._closed:
            raise ClosedError(f"{self.name}: the tier is closed")
        if self._tier is not None:
            return self._tier
        await asyncio.wait({self._opening})
        if self._opening.cancelled():
            raise ClosedError(f"{self.name}: the open was cancelled")
        exc = self._opening.exception()
        if exc is not None:
            if isinstance(exc, KvtierError):
                raise exc
            raise TierIOError(f"{self.name}: the tier did not open: {exc!r}") from exc
        return self._opening.result()

    def _check_open_or_opening(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.name}: the tier is closed")

    # -- the contract ------------------------------------------------------------------------------

    async def put_many(self, items: Sequence[PutItem]) -> int:
        # Handed to the tier even if the caller is cancelled while the open runs (the contract: a
        # put still lands), so the call ends only once the put has (the buffer rule).
        batch = list(items)
        for key, _, _ in batch:
            check_key(key)  # refused at once, not after the open
        return await settle(self._put_when_open(batch))

    async def _put_when_open(self, items: List[PutItem]) -> int:
        return await (await self._ready()).put_many(items)

    def start_put(self, items: Sequence[PutItem], *, after: "Optional[asyncio.Future[Any]]" = None) -> StartedPut:
        self._check_open_or_opening()
        if self._tier is not None:
            return self._tier.start_put(items, after=after)
        return super().start_put(items, after=after)  # waits for ``after``, then put_many (the open)

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        self._check_open_or_opening()
        if self._tier is None:
            for key, _ in items:
                check_key(key)
            return [None] * len(items)
        return await self._tier.get_many_into(items)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        batch = [check_key(key) for key in keys]
        return await settle(self._delete_when_open(batch))  # a cancelled delete still happens

    async def _delete_when_open(self, keys: List[bytes]) -> int:
        return await (await self._ready()).delete_many(keys)

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        self._check_open_or_opening()
        if self._tier is None:
            for key in keys:
                check_key(key)
            return [False] * len(keys)
        return await self._tier.contains_many(keys)

    async def list_keys(self) -> List[bytes]:
        return await (await self._ready()).list_keys()

    async def snapshot_keys(self) -> KeySnapshot:
        return await (await self._ready()).snapshot_keys()

    async def flush(self) -> None:
        await (await self._ready()).flush()

    async def sync_removals(self) -> None:
        await (await self._ready()).sync_removals()

    async def check(self) -> List[str]:
        return await (await self._ready()).check()

    def touch_many(self, keys: Sequence[bytes]) -> None:
        if self._tier is not None:
            self._tier.touch_many(keys)

    def subscribe_removals(self, callback: RemovalCallback) -> None:
        if self._tier is not None:
            self._tier.subscribe_removals(callback)
        else:
            self._subscribers.append(callback)

    def statistics(self) -> TierStatistics:
        tier = self._tier
        return tier.statistics() if tier is not None else TierStatistics()

    @property
    def sequence(self) -> int:
        tier = self._tier
        return tier.sequence if tier is not None else 0

    @property
    def degraded(self) -> bool:
        tier = self._tier
        return tier.degraded if tier is not None else False

    @property
    def capacity_bytes(self) -> Optional[int]:
        tier = self._tier
        return tier.capacity_bytes if tier is not None else None

    @property
    def closed(self) -> bool:
        tier = self._tier
        return self._closed or (tier is not None and tier.closed)  # a holder of the tier may close it

    async def close(self) -> None:
        """Close: wait for the open to end (a worker thread cannot be stopped), then close the tier
        it gave. Safe to call twice. Cancelling it: the open runs on; call it again to finish."""
        self._closed = True
        await asyncio.wait({self._opening})
        if not self._opening.cancelled() and self._opening.exception() is None:
            await self._opening.result().close()

    def __getattr__(self, name: str) -> Any:
        # Only for names this class lacks: what a tier has beyond the contract, once it is open.
        if name.startswith("__") or name in ("_tier", "_opening", "_subscribers"):
            raise AttributeError(name)
        tier = self._tier
        if tier is None:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r} while the tier is opening")
        return getattr(tier, name)
