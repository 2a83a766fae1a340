"""The load path: disk -> host slot -> device blocks, in windows, with single-flight promotions.

Primitives: ``LoadPath`` (``run`` one load's jobs, ``start_promotion`` of disk-only chunks for a
load or a prefetch). Event-loop thread; the copies run on the engine's host -> device thread and
the reads on the disk tier's threads.

Rules kept here (issue 10): a load moves through the host pool in windows of at most half of each
group's slots, so a hit larger than the pool still loads (defect 4); a read or a copy failing with
*any* exception fails the load with a reason and leaves nothing LOADING or pinned (defect 8); a
promotion whose read stalls past ``tier_timeout_s`` is abandoned -- its waiters fail, lookup answers
from the disk index again -- while its slots stay pinned until the tier lets go of the buffers
(defect 9); an executor copy is awaited to its end before its pins go (``tasks.settle``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from kvtier.errors import ClosedError

from kvtier.tiers.chain import read_with_sources

from .lifecycle import HostState
from .records import ChunkEntry, LoadResult
from .tasks import settle, wait_all

if TYPE_CHECKING:  # pragma: no cover
    from .engine import OffloadEngine

__all__ = ["LoadPath"]

logger = logging.getLogger("kvtier.engine")


class LoadPath:
    """Loads and promotions for one engine (see the module docstring)."""

    def __init__(self, engine: "OffloadEngine") -> None:
        self._engine = engine

    def _load_windows(self, jobs) -> List[list]:
        """Split a load's jobs so that no window needs more than half of a group's host slots: the
        other half stays for stores and other loads, and a hit of any size streams through."""
        engine = self._engine
        caps = [max(1, pool.num_slots // 2) for pool in engine._pools]
        windows: List[list] = []
        current: list = []
        counts: Dict[int, int] = {}
        for job in jobs:
            gi = job[0]
            if counts.get(gi, 0) >= caps[gi]:
                windows.append(current)
                current, counts = [], {}
            current.append(job)
            counts[gi] = counts.get(gi, 0) + 1
        if current:
            windows.append(current)
        return windows

    async def run(self, hit_tokens: int, jobs, finished: asyncio.Future, ready) -> LoadResult:
        engine = self._engine
        loaded: List[Tuple[int, int]] = []
        from_disk = 0
        try:
            for window in self._load_windows(jobs):
                reason, read = await self._load_window(window, loaded, ready)
                from_disk += read
                if reason is not None:
                    engine.metrics.miss(reason)
                    return LoadResult(hit_tokens, False, (), reason=reason)
            return LoadResult(
                hit_tokens, True, tuple(loaded), chunks_from_disk=from_disk, chunks_from_host=len(jobs) - from_disk
            )
        finally:
            if not finished.done():
                finished.set_result(None)

    async def _load_window(self, window, loaded: List[Tuple[int, int]], ready) -> Tuple[Optional[str], int]:
        """Acquire, copy and release one window of a load. Returns (failure reason, chunks read)."""
        engine = self._engine
        pinned: List[ChunkEntry] = []
        try:
            entries, from_disk, reason = await self._acquire_chunks([(g, c, k) for g, c, k, _ in window], pinned)
            if reason is not None:
                return reason, from_disk
            if engine._closing:
                raise ClosedError("the offload engine closed during the load")
            batch = []
            for (gi, chunk, _key, targets), entry in zip(window, entries):
                batch.append((gi, engine._pools[gi].view(entry.slot), targets))
                per_chunk = engine.layout.groups[gi].blocks_per_chunk
                loaded.extend((gi, chunk * per_chunk + i) for i, t in enumerate(targets) if t is not None)
                engine._pools[gi].touch(entry.slot)
            started = time.perf_counter()
            try:
                scatter = functools.partial(engine.device.scatter_many_groups, batch, ready_event=ready)
                await settle(engine._loop.run_in_executor(engine._h2d, scatter))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("host -> device copy failed: %r", exc)
                engine.metrics.worker_error("load_copy")
                return "copy_error", from_disk
            nbytes = sum(engine._chunk_nbytes[g] for g, _, _ in batch)
            engine.metrics.loaded("device", len(batch), nbytes)
            engine.metrics.latency("device", "load", time.perf_counter() - started)
            return None, from_disk
        finally:
            for entry in pinned:
                engine._unpin(entry)

    async def _acquire_chunks(self, wanted, pinned: List[ChunkEntry]):
        """Pin a host entry for every wanted chunk, promoting disk-only chunks (single flight).
        Returns (entries, chunks read from disk, failure reason or None)."""
        engine = self._engine
        entries: List[Optional[ChunkEntry]] = []
        to_promote = []
        resident_on_disk: List[bytes] = []
        host_bytes = 0
        for gi, chunk, key in wanted:
            entry = engine._entries.get(key)
            if entry is None:
                if key not in engine._index:
                    return [], 0, "missing"
                to_promote.append((gi, chunk, key))
                entries.append(None)
                continue
            engine._pin(entry)
            pinned.append(entry)
            entries.append(entry)
            if key in engine._index:
                resident_on_disk.append(key)
            host_bytes += engine._chunk_nbytes[gi]
        promoted: List[ChunkEntry] = []
        if to_promote:
            promoted = self.start_promotion(to_promote)
            if promoted is None:
                return [], 0, "host_full"
            for entry in promoted:
                engine._pin(entry)
                pinned.append(entry)
            it = iter(promoted)
            entries = [e if e is not None else next(it) for e in entries]
        waits = [e.ready for e in entries if e.state in (HostState.PENDING, HostState.LOADING)]
        if waits:
            try:
                reasons = await asyncio.wait_for(
                    asyncio.gather(*(asyncio.shield(w) for w in waits)), engine.config.tier_timeout_s
                )
            except asyncio.TimeoutError:
                for entry in entries:
                    if entry.state is HostState.LOADING and not entry.dead:
                        self._abandon(entry, "timeout")
                return [], 0, "timeout"
            failed = [r for r in reasons if r is not None]
            if failed:
                return [], 0, failed[0]
        if resident_on_disk and engine._disk is not None:
            # Served from the host, but a use all the same: the disk's LRU hears of it (after the
            # promotions' reads, in the load's order), or a chunk kept hot on the host ages out of
            # the disk and is gone for good once the host evicts it (no store writes it again).
            try:
                engine._disk.touch_many(resident_on_disk)
            except Exception as exc:  # noqa: BLE001 - a recency hint: never a reason to fail the load
                logger.debug("disk tier touch failed: %r", exc)
        if len(entries) > len(promoted):  # the chunks this load found on the host tier
            engine.metrics.loaded("host", len(entries) - len(promoted), host_bytes)
        return entries, len(promoted), None

    def start_promotion(self, wanted) -> Optional[List[ChunkEntry]]:
        """Allocate slots and start one disk read for ``wanted`` (group, chunk, key) chunks; the
        read runs in an engine-owned task, so no caller's cancellation can cut it short."""
        engine = self._engine
        slots = engine._allocate_slots(g for g, _, _ in wanted)
        if slots is None:
            return None
        # The read's own pin is held until the worker reports.
        entries = engine._new_entries(wanted, HostState.LOADING, slots)
        engine._spawn(self._promote([(e, e.generation) for e in entries]))
        return entries

    async def _promote(self, work: List[Tuple[ChunkEntry, int]]) -> None:
        engine = self._engine
        items = [(e.key, engine._pools[e.group_index].buffer(e.slot)) for e, _ in work]
        started = time.perf_counter()
        # A miss is "corrupt" only when the tier counted a bad record meanwhile; else the record is
        # gone (another process's gc, an eviction the index has not heard of): "missing".
        bad_before = _bad_reads(engine._disk)
        read = asyncio.ensure_future(read_with_sources(engine._disk, items))
        done, _ = await asyncio.wait([read], timeout=engine.config.tier_timeout_s)
        if not done:
            # A stalled read: its waiters fail now and lookup answers from the disk index again;
            # the slots stay pinned until the tier lets go of the buffers.
            logger.warning("disk read of %d chunks took more than %.1f s; abandoned", len(items),
                           engine.config.tier_timeout_s)
            engine.metrics.worker_error("promote_timeout")
            for entry, generation in work:
                if entry.generation == generation and not entry.dead:
                    self._abandon(entry, "timeout")
            await wait_all([read])
        try:
            metas, sources = read.result()
            failure = "corrupt" if _bad_reads(engine._disk) != bad_before else "missing"
        except Exception as exc:  # any exception: a foreign one must not leave entries LOADING
            logger.warning("disk read of %d chunks failed: %r", len(items), exc)
            engine.metrics.worker_error("promote")
            metas, sources, failure = [None] * len(items), [None] * len(items), "tier_error"
        served: Dict[str, List[int]] = {}  # tier name -> [chunks, bytes] this read restored
        for (entry, generation), meta, source in zip(work, metas, sources):
            engine._unpin(entry)
            if entry.generation != generation or entry.dead:
                continue  # abandoned (timeout): the late result is discarded
            expected_dtype, expected_shape = engine._metas[entry.group_index]
            if meta is not None and (
                meta.fingerprint != engine.fingerprint
                or meta.group_index != entry.group_index
                or meta.chunk_index != entry.chunk_index
                or meta.dtype != expected_dtype
                or tuple(meta.shape) != expected_shape
            ):
                meta, failure = None, "corrupt"
            if meta is None:
                if failure in ("corrupt", "missing"):  # the record is gone; a tier error may pass
                    engine._index.discard(entry.key)
                engine._drop_entry(entry, None)
                engine._resolve_ready(entry, failure)
                continue
            engine._settle_ready(entry)
            counts = served.setdefault(_TIER_NAMES[min(source or 0, 1)], [0, 0])
            counts[0] += 1
            counts[1] += engine._chunk_nbytes[entry.group_index]
            engine._events.append("stored", entry.key, entry.group_index, "host")
            engine._resolve_ready(entry, None)
        # "disk" counts every chunk the disk tier (a chain: all of its tiers) gave back, as it
        # always has; "remote" the part of them a chain's remote tier served, and the reads that
        # needed it (their latency includes the disk miss before it)
        chunks = sum(c for c, _ in served.values())
        if chunks:
            elapsed = time.perf_counter() - started
            engine.metrics.loaded("disk", chunks, sum(b for _, b in served.values()))
            engine.metrics.latency("disk", "get", elapsed)
            if "remote" in served:
                engine.metrics.loaded("remote", *served["remote"])
                engine.metrics.latency("remote", "get", elapsed)

    def _abandon(self, entry: ChunkEntry, reason: str) -> None:
        """Give up on an in-flight read: waiters fail now; the slot stays reserved (pinned by the
        read) until the worker reports, and its late result is discarded by generation."""
        engine = self._engine
        entry.generation += 1
        engine._drop_entry(entry, None)
        engine._resolve_ready(entry, reason)


def _bad_reads(tier) -> int:
    """Records the tier counted bad on reads so far (checksum or parse failures, wrong sizes)."""
    stats = tier.statistics()
    return stats.corrupt + stats.mismatched


# The disk tier's own records, and a chain's lower (remote) tiers, as metric labels.
_TIER_NAMES = ("disk", "remote")
