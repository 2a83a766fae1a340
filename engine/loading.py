"""The load path: disk -> host slot -> device blocks, in windows, with single-flight promotions.

Primitives: ``LoadPath`` (``plan`` a load's jobs from its checked block table, ``start`` them as
an engine-owned task, ``promotable`` disk-only chunks of a hit, ``start_promotion`` of them for a
load or a prefetch). Event-loop thread; the copies run on the host -> device executor it is given
and the reads on the disk tier's threads. Host slots and entries change only through the engine's
``HostBook``.

Rules kept here: a load moves through the host pool in windows of at most half of each group's
slots, so a hit larger than the pool still loads; a read or a copy failing with *any* exception
fails the load with a reason and leaves nothing LOADING or pinned; a promotion whose read stalls
past ``tier_timeout_s`` is abandoned -- its waiters fail, lookup answers from the disk index
again -- while its slots stay pinned until the tier lets go of the buffers (it may still write
into them); an executor copy is awaited to its end before its pins go (``tasks.settle``); the
host-only chunks a load served go to the disk once its last window is done (``_hand_to_disk``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import Executor
from typing import AbstractSet, Callable, Coroutine, Dict, List, Optional, Sequence, Set, Tuple

from kvtier.errors import ClosedError, EngineInvariantError
from kvtier.policy import ModelLayout
from kvtier.policy.plan import load_block_plan
from kvtier.tiers.base import ChunkTier
from kvtier.tiers.chain import read_with_sources
from kvtier.tiers.device import DeviceKVView

from .config import EngineConfig
from .disk_index import DiskIndex
from .events import EventLog
from .host_book import HostBook
from .lifecycle import HostState
from .metrics import EngineMetrics
from .records import ChunkEntry, LoadResult, RequestKeys
from .tasks import settle, wait_all
from .validation import check_load_blocks, valid_load_plan_targets

# (group, chunk, key, device block per block of the chunk or None) of one chunk a load restores
LoadJob = Tuple[int, int, bytes, List[Optional[int]]]

__all__ = ["LoadPath"]

logger = logging.getLogger("kvtier.engine")


class LoadPath:
    """Loads and promotions for one engine (see the module docstring). ``tier`` is ``None``
    without a disk tier; ``closing()`` is the engine's; ``spawn`` runs a coroutine as an
    engine-owned task."""

    def __init__(self, book: HostBook, index: DiskIndex, tier: Optional[ChunkTier], *, layout: ModelLayout,
                 config: EngineConfig, device: DeviceKVView, executor: Executor, loop: asyncio.AbstractEventLoop,
                 metrics: EngineMetrics,
                 events: EventLog, spawn: Callable[[Coroutine], asyncio.Task], closing: Callable[[], bool],
                 write_back: Callable[[Sequence[ChunkEntry]], None] = lambda entries: None) -> None:
        self._book = book
        self._write_back = write_back  # host-only chunks a load hit, for the disk (StorePath.write_back)
        self._index = index
        self._tier = tier
        self._layout = layout
        self._config = config
        self._device = device
        self._executor = executor
        self._loop = loop
        self._metrics = metrics
        self._events = events
        self._spawn = spawn
        self._closing = closing

    def plan(self, keys: RequestKeys, hit_tokens: int,
             block_table: Sequence[Sequence[Optional[int]]]) -> Tuple[List[LoadJob], bool]:
        """The jobs of a load of ``hit_tokens`` (checked by ``check_load_arguments``) into
        ``block_table``, and whether a chunk of the hit has no key (a miss). Refuses a table that
        lacks, repeats or overruns a device block the hit restores, before anything is scheduled."""
        jobs: List[LoadJob] = []
        missing = False
        for gi in range(len(self._layout.groups)):
            row = block_table[gi]
            limit = self._book.num_blocks[gi]
            seen: Dict[int, int] = {}
            group_keys = keys.keys[gi]
            count = len(group_keys)
            plan = load_block_plan(self._layout, gi, hit_tokens)
            if not plan:
                continue
            first, last = plan[0][0], plan[-1][0]
            if 0 <= first and last < count and last - first + 1 == len(plan):  # consecutive: one slice
                chunk_keys: Sequence[Optional[bytes]] = group_keys[first : last + 1]
            else:
                chunk_keys = [group_keys[chunk] if 0 <= chunk < count else None for chunk, _ in plan]
            checked = valid_load_plan_targets(row, plan, limit)
            for i, ((chunk, blocks), key) in enumerate(zip(plan, chunk_keys)):
                if key is None:
                    missing = True
                    continue
                targets = checked[i] if checked is not None else check_load_blocks(gi, row, blocks, limit, seen)
                jobs.append((gi, chunk, key, targets))
        return jobs, missing

    def start(self, hit_tokens: int, jobs: List[LoadJob], ready) -> asyncio.Task:
        """Run the load in an engine-owned task; its blocks are fenced from now until its last
        copy ended."""
        finished = self._loop.create_future()
        self._book.mark_busy([(g, targets) for g, _, _, targets in jobs], finished)
        return self._spawn(self.run(hit_tokens, jobs, finished, ready, self._hold_host_only(jobs)))

    def _hold_host_only(self, jobs: List[LoadJob]) -> Set[ChunkEntry]:
        """Pin, for the whole load, the hit's host chunks the disk does not hold: lookup admitted
        them, and nothing could read them again once evicted, while an earlier window's promotions
        (or another request's stores) between windows would pick them as victims."""
        book, index, entries = self._book, self._index, self._book.entries
        held = set()
        for _, _, key, _ in jobs:
            entry = entries.get(key)
            if entry is not None and key not in index and entry not in held:
                book.pin(entry)
                held.add(entry)
        return held

    def promotable(self, keys: RequestKeys, hit_tokens: int) -> List[Tuple[int, int, bytes]]:
        """The (group, chunk, key) chunks of a hit of ``hit_tokens`` found on disk only."""
        entries, index = self._book.entries, self._index
        wanted = []
        for gi in range(len(self._layout.groups)):
            for chunk, _ in load_block_plan(self._layout, gi, hit_tokens):
                key = keys.key(gi, chunk)
                if key is not None and key not in entries and key in index:
                    wanted.append((gi, chunk, key))
        return wanted

    def _load_windows(self, jobs) -> List[list]:
        """Split a load's jobs so that no window needs more than half of a group's host slots: the
        other half stays for stores and other loads, and a hit of any size streams through."""
        caps = [max(1, pool.num_slots // 2) for pool in self._book.pools]
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

    async def run(self, hit_tokens: int, jobs, finished: asyncio.Future, ready,
                  held: AbstractSet[ChunkEntry] = frozenset()) -> LoadResult:
        """The load's engine-owned task; ``held``: entries pinned for the whole load (released at
        its end), which its windows then need not pin again."""
        loaded: List[Tuple[int, int]] = []
        host_only: List[ChunkEntry] = []  # READY chunks off the disk that the windows served
        from_disk = 0
        reason: Optional[str] = None
        try:
            for window in self._load_windows(jobs):
                reason, read = await self._load_window(window, loaded, ready, held, host_only)
                from_disk += read
                if reason is not None:
                    break
            self._hand_to_disk(host_only)
            if reason is not None:
                self._metrics.miss(reason)
                return LoadResult(hit_tokens, False, (), reason=reason)
            return LoadResult(
                hit_tokens, True, tuple(loaded), chunks_from_disk=from_disk, chunks_from_host=len(jobs) - from_disk
            )
        finally:
            for entry in held:
                self._book.unpin(entry)
            if not finished.done():
                finished.set_result(None)

    async def _load_window(self, window, loaded: List[Tuple[int, int]], ready, held: AbstractSet[ChunkEntry],
                           host_only: List[ChunkEntry]) -> Tuple[Optional[str], int]:
        """Acquire, copy and release one window of a load (its host-only chunks join
        ``host_only``). Returns (failure reason, chunks read)."""
        book = self._book
        pinned: List[ChunkEntry] = []
        try:
            entries, from_disk, reason = await self._acquire_chunks([(g, c, k) for g, c, k, _ in window], pinned, held,
                                                                    host_only)
            if reason is not None:
                return reason, from_disk
            if self._closing():
                raise ClosedError("the offload engine closed during the load")
            batch = []
            groups = self._layout.groups
            for (gi, chunk, _key, targets), entry in zip(window, entries):
                batch.append((gi, book.view(entry), targets))
                first = chunk * groups[gi].blocks_per_chunk
                loaded.extend([(gi, first + i) for i, t in enumerate(targets) if t is not None])
                book.touch(entry)
            started = time.perf_counter()
            try:
                scatter = functools.partial(self._device.scatter_many_groups, batch, ready_event=ready)
                await settle(self._loop.run_in_executor(self._executor, scatter))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("host -> device copy failed: %r", exc)
                self._metrics.worker_error("load_copy")
                return "copy_error", from_disk
            nbytes = sum(book.chunk_nbytes[g] for g, _, _ in batch)
            self._metrics.loaded("device", len(batch), nbytes)
            self._metrics.latency("device", "load", time.perf_counter() - started)
            return None, from_disk
        finally:
            for entry in pinned:
                book.unpin(entry)

    async def _acquire_chunks(self, wanted, pinned: List[ChunkEntry], held: AbstractSet[ChunkEntry],
                              host_only: List[ChunkEntry]):
        """Pin a host entry for every wanted chunk (an entry in ``held`` is pinned already),
        promoting disk-only chunks (single flight); the READY ones the disk does not hold join
        ``host_only``. Returns (entries, chunks read from disk, failure reason or None)."""
        book, index = self._book, self._index
        found: List[Optional[ChunkEntry]] = []  # None: to promote
        to_promote = []
        resident_on_disk: List[bytes] = []
        host_bytes = 0
        for gi, chunk, key in wanted:
            entry = book.entries.get(key)
            if entry is None:
                if key not in index:
                    return [], 0, "missing"
                to_promote.append((gi, chunk, key))
                found.append(None)
                continue
            if entry not in held:
                book.pin(entry)
                pinned.append(entry)
            found.append(entry)
            if key in index:
                resident_on_disk.append(key)
            host_bytes += book.chunk_nbytes[gi]
        promoted: List[ChunkEntry] = []
        if to_promote:
            started = self.start_promotion(to_promote)
            if started is None:
                return [], 0, "host_full"
            promoted = started
            for entry in promoted:
                book.pin(entry)
                pinned.append(entry)
        it = iter(promoted)
        entries = [e if e is not None else next(it) for e in found]
        waits = [book.waiter(e) for e in entries if e.state is HostState.PENDING or e.state is HostState.LOADING]
        if waits:
            try:
                reasons = await asyncio.wait_for(
                    asyncio.gather(*(asyncio.shield(w) for w in waits)), self._config.tier_timeout_s
                )
            except asyncio.TimeoutError:
                for entry in entries:
                    if entry.state is HostState.LOADING and not entry.dead:
                        self._abandon(entry, "timeout")
                return [], 0, "timeout"
            failed = [r for r in reasons if r is not None]
            if failed:
                return [], 0, failed[0]
        if resident_on_disk and self._tier is not None:
            # Served from the host, but a use all the same: the disk's LRU hears of it (after the
            # promotions' reads, in the load's order), or a chunk kept hot on the host ages out of
            # the disk and is gone for good once the host evicts it (no store writes it again).
            try:
                self._tier.touch_many(resident_on_disk)
            except Exception as exc:  # noqa: BLE001 - a recency hint: never a reason to fail the load
                logger.debug("disk tier touch failed: %r", exc)
        host_only.extend(e for e, on_host in zip(entries, found)
                         if on_host is not None and e.state is HostState.READY and e.key not in index)
        if len(entries) > len(promoted):  # the chunks this load found on the host tier
            self._metrics.loaded("host", len(entries) - len(promoted), host_bytes)
        return entries, len(promoted), None

    def start_promotion(self, wanted) -> Optional[List[ChunkEntry]]:
        """Allocate slots and start one disk read for ``wanted`` (group, chunk, key) chunks; the
        read runs in an engine-owned task, so no caller's cancellation can cut it short."""
        tier = self._tier
        if tier is None:  # the disk index names keys of a tier only: an engine bug
            raise EngineInvariantError("a promotion was asked of an engine without a disk tier")
        slots = self._book.allocate(g for g, _, _ in wanted)
        if slots is None:
            return None
        # The read's own pin is held until the worker reports.
        entries = self._book.add_entries(wanted, HostState.LOADING, slots)
        self._spawn(self._promote(tier, [(e, e.generation) for e in entries]))
        return entries

    async def _promote(self, tier: ChunkTier, work: List[Tuple[ChunkEntry, int]]) -> None:
        book, timeout_s = self._book, self._config.tier_timeout_s
        items = [(e.key, book.buffer(e)) for e, _ in work]
        started = time.perf_counter()
        # A miss is "corrupt" only when the tier counted a bad record meanwhile; else the record is
        # gone (another process's gc, an eviction the index has not heard of): "missing".
        bad_before = _bad_reads(tier)
        read = asyncio.ensure_future(read_with_sources(tier, items))
        done, _ = await asyncio.wait([read], timeout=timeout_s)
        if not done:
            # A stalled read: its waiters fail now and lookup answers from the disk index again;
            # the slots stay pinned until the tier lets go of the buffers.
            logger.warning("disk read of %d chunks took more than %.1f s; abandoned", len(items), timeout_s)
            self._metrics.worker_error("promote_timeout")
            for entry, generation in work:
                if entry.generation == generation and not entry.dead:
                    self._abandon(entry, "timeout")
            await wait_all([read])
        try:
            metas, sources = read.result()
            failure = "corrupt" if _bad_reads(tier) != bad_before else "missing"
        except Exception as exc:  # any exception: a foreign one must not leave entries LOADING
            logger.warning("disk read of %d chunks failed: %r", len(items), exc)
            self._metrics.worker_error("promote")
            metas, sources, failure = [None] * len(items), [None] * len(items), "tier_error"
        served: Dict[str, List[int]] = {}  # tier name -> [chunks, bytes] this read restored
        for (entry, generation), meta, source in zip(work, metas, sources):
            book.unpin(entry)
            if entry.generation != generation or entry.dead:
                continue  # abandoned (timeout): the late result is discarded
            if meta is not None and not book.is_own_meta(entry, meta):
                meta, failure = None, "corrupt"
            if meta is None:
                if failure in ("corrupt", "missing"):  # the record is gone; a tier error may pass
                    self._index.discard(entry.key)
                book.drop(entry, None)
                book.resolve(entry, failure)
                continue
            book.settle_ready(entry)
            counts = served.setdefault(_TIER_NAMES[min(source or 0, 1)], [0, 0])
            counts[0] += 1
            counts[1] += book.chunk_nbytes[entry.group_index]
            self._events.append("stored", entry.key, entry.group_index, "host")
            book.resolve(entry, None)
        # "disk" counts every chunk the disk tier (a chain: all of its tiers) gave back, as it
        # always has; "remote" the part of them a chain's remote tier served, and the reads that
        # needed it (their latency includes the disk miss before it)
        chunks = sum(c for c, _ in served.values())
        if chunks:
            elapsed = time.perf_counter() - started
            self._metrics.loaded("disk", chunks, sum(b for _, b in served.values()))
            self._metrics.latency("disk", "get", elapsed)
            if "remote" in served:
                self._metrics.loaded("remote", *served["remote"])
                self._metrics.latency("remote", "get", elapsed)

    def _hand_to_disk(self, host_only: Sequence[ChunkEntry]) -> None:
        """Hand the host-only chunks a load served to the disk (``StorePath.write_back``), once its
        last window is done: their writes, and the disk evictions that make room for them, then
        follow every read and touch of the load (the disk's LRU hears of those before it picks a
        victim), and cannot evict a chunk a later window of the same load is about to read. Each
        chunk still READY and off the disk (another load may have handed it over meanwhile)."""
        index = self._index
        ready = [e for e in host_only if e.state is HostState.READY and not e.dead and e.key not in index]
        if ready:
            self._write_back(ready)

    def _abandon(self, entry: ChunkEntry, reason: str) -> None:
        """Give up on an in-flight read: waiters fail now; the slot stays reserved (pinned by the
        read) until the worker reports, and its late result is discarded by generation."""
        entry.generation += 1
        self._book.drop(entry, None)
        self._book.resolve(entry, reason)


def _bad_reads(tier) -> int:
    """Records the tier counted bad on reads so far (checksum or parse failures, wrong sizes)."""
    stats = tier.statistics()
    return stats.corrupt + stats.mismatched


# The disk tier's own records, and a chain's lower (remote) tiers, as metric labels.
_TIER_NAMES = ("disk", "remote")
