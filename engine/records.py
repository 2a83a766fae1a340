"""The engine's bookkeeping types: per-chunk entries, store handles, load results, events.

Primitives: ``HostState`` (defined with the lifecycle table in ``lifecycle.py``), ``ChunkEntry``,
``StoreHandle``, ``LoadResult``, ``ChunkEvent``, ``RequestKeys``. All of them are touched only on the engine's event-loop thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

from kvtier.policy.keys import KeyChain, TokenIds

from .lifecycle import HostState
from .validation import check_token_ids

__all__ = ["HostState", "ChunkEntry", "StoreHandle", "StoreResult", "LoadResult", "ChunkEvent", "RequestKeys"]


@dataclass(eq=False, slots=True)  # slots: ~30% cheaper to make, one per chunk stored or read
class ChunkEntry:
    """One chunk with a host slot. Its pins (readers and writers of the slot; a pinned slot is
    never evicted or released) are counted by the slot's pool alone (``HostBook.pins``).
    ``generation`` changes whenever an in-flight operation is abandoned (timeout, close), so its
    late completion is recognised and discarded. ``state`` moves only through ``lifecycle.move``
    (the transition table)."""

    key: bytes
    group_index: int
    chunk_index: int
    state: HostState
    slot: int
    generation: int = 0
    dead: bool = False  # removed from the index; the slot is released when the last pin goes
    # Resolves when the in-flight copy ends: None when READY, else the failure reason. Made by the
    # first ``HostBook.waiter`` (most chunks are never waited for; a future costs ~0.8 us to make).
    ready: Optional[asyncio.Future] = None
    settled: bool = False  # the in-flight copy ended (``HostBook.resolve``), with ``reason``
    reason: Optional[str] = None


@dataclass(frozen=True)
class ChunkEvent:
    """A chunk appeared in or left a tier: what a router tracking prefix locations consumes.
    ``group_index`` is -1 when the engine no longer knows it (a record another process or the
    tier's own eviction removed from disk)."""

    kind: str  # "stored" | "removed"
    key: bytes
    group_index: int
    tier: str  # "host" | "disk"


@dataclass(frozen=True)
class StoreResult:
    """What one store did: chunks scheduled per group, chunks skipped because already stored or in
    flight, chunks dropped with the reason, and whether every scheduled chunk reached the disk."""

    scheduled: Tuple[Tuple[int, int], ...]
    skipped: Tuple[Tuple[int, int], ...]
    dropped: Tuple[Tuple[int, int], ...]
    drop_reason: Optional[str]
    durable: bool


class StoreHandle:
    """Returned at once by ``OffloadEngine.store``. Two moments, separately:

    - ``wait_released()``: the device -> host copy finished; the serving process may reuse the
      device blocks now (never before).
    - ``wait_durable()``: every scheduled chunk is on disk (``True``), or some could not be
      (``False``: no disk tier, spill failed or the chunk was dropped).

    ``await handle`` waits for both and returns a ``StoreResult``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, scheduled, skipped, dropped, drop_reason):
        self.scheduled: Tuple[Tuple[int, int], ...] = tuple(scheduled)
        self.skipped: Tuple[Tuple[int, int], ...] = tuple(skipped)
        self.dropped: Tuple[Tuple[int, int], ...] = tuple(dropped)
        self.drop_reason: Optional[str] = drop_reason
        self._released: asyncio.Future = loop.create_future()
        self._durable: asyncio.Future = loop.create_future()

    async def wait_released(self) -> None:
        """Wait until the device blocks may be reused. Cancelling the wait does not stop the copy."""
        await asyncio.shield(self._released)

    async def wait_durable(self) -> bool:
        """Wait until the scheduled chunks are on disk; ``False`` when some will never be.
        Cancelling the wait does not stop the spill."""
        return await asyncio.shield(self._durable)

    @property
    def released(self) -> bool:
        return self._released.done()

    @property
    def durable_known(self) -> bool:
        """Whether ``wait_durable()`` would answer at once."""
        return self._durable.done()

    # The engine resolves a handle through ``mark_released`` / ``mark_durable`` below, never by
    # touching its futures; both are idempotent, so a late or repeated resolution cannot raise on
    # the event loop.
    def _mark_released(self) -> None:
        if not self._released.done():
            self._released.set_result(None)

    def _mark_durable(self, ok: bool) -> None:
        if not self._durable.done():
            self._durable.set_result(bool(ok))

    async def _wait(self) -> StoreResult:
        await self.wait_released()
        durable = await self.wait_durable()
        return StoreResult(self.scheduled, self.skipped, self.dropped, self.drop_reason, durable)

    def __await__(self):
        return self._wait().__await__()


def mark_released(handle: StoreHandle) -> None:
    """The store's device -> host copy ended: the caller may reuse its device blocks."""
    handle._mark_released()


def mark_durable(handle: StoreHandle, ok: bool) -> None:
    """Every scheduled chunk of the store reached the disk (``ok``), or some never will."""
    handle._mark_durable(ok)


@dataclass(frozen=True)
class LoadResult:
    """What one load did. ``ok`` is False when any needed chunk could not be read (the serving
    process then recomputes); ``reason`` says why ("missing", "corrupt", "timeout", "host_full")."""

    hit_tokens: int
    ok: bool
    loaded: Tuple[Tuple[int, int], ...]  # (group, logical block) written to the device
    chunks_from_disk: int = 0
    chunks_from_host: int = 0
    reason: Optional[str] = None


@dataclass(frozen=True)
class RequestKeys:
    """A request's chunk keys per group, computed once and reused by lookup, load and store.

    Made from token ids (``OffloadEngine.request_keys``), ``keys[g]`` is a lazy sequence backed by
    ``chain`` (a ``kvtier.policy.KeyChain``): each key is hashed when first read, and
    ``extended(more_token_ids)`` grows the request paying for the new tokens only. Made from keys
    computed elsewhere (vLLM's block hashes), ``keys`` holds them and ``chain`` is None."""

    keys: Tuple[Sequence[bytes], ...]
    num_tokens: int
    salt_bound: bool = False
    chain: Optional[KeyChain] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_chain(cls, chain: KeyChain) -> "RequestKeys":
        return cls(chain.keys, chain.num_tokens, chain.salted, chain)

    def extended(self, more_token_ids: TokenIds) -> "RequestKeys":
        """The keys of this request followed by ``more_token_ids`` (a decode step's new tokens);
        ``self`` stays valid and unchanged. Costs O(new tokens), not O(request)."""
        if self.chain is None:
            raise ValueError("these RequestKeys hold keys made elsewhere, not token ids; they cannot be extended")
        return RequestKeys.from_chain(self.chain.extended(check_token_ids(more_token_ids, "more_token_ids")))

    def key(self, group_index: int, chunk_index: int) -> Optional[bytes]:
        group_keys = self.keys[group_index]
        return group_keys[chunk_index] if 0 <= chunk_index < len(group_keys) else None
