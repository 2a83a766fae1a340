"""The store path: device blocks -> host slots, then handed to the spill pipeline.

Primitives: ``StorePath`` (``schedule`` one request's store, ``inflight`` chunks whose copy has not
reported yet). Event-loop thread; the copy runs on the device -> host executor it is given (the
CPU stand-in for the CUDA d2h stream), ordered after the event ``OffloadEngine.store`` took at call
time. Host slots and entries change only through the engine's ``HostBook``.

Rules kept here: a store that finds its chunks already in flight waits for their spill before its
handle says durable (another store's copy is no promise of this one's); slots are taken all or nothing across groups, so a group
that cannot make room evicts nothing anywhere; a copy failing with *any* exception drops its chunks
with a reason and still releases the caller's device blocks; the engine's own task is never
cancelled by a caller (``tasks.settle``), so the books are always finished here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import Executor
from typing import Callable, Coroutine, Dict, FrozenSet, List, Optional, Sequence, Tuple, cast

from kvtier.errors import ClosedError
from kvtier.policy import ModelLayout
from kvtier.policy.retention import retention_speculative_limit, retention_store_chunk_indices
from kvtier.tiers.admission import Admission, AdmitAll, make_admission, tier_chunks
from kvtier.tiers.device import DeviceKVView

from .config import EngineConfig
from .disk_index import DiskIndex
from .drop_log import DropLog, drop_detail
from .durable import DurableWatch
from .events import EventLog
from .host_book import HostBook
from .lifecycle import DURABLE_LATER, HostState
from .metrics import EngineMetrics
from .records import ChunkEntry, RequestKeys, StoreHandle, mark_durable, mark_released
from .spill import SpillPipeline
from .tasks import settle
from .validation import check_store_blocks, valid_store_run

__all__ = ["StorePath"]

logger = logging.getLogger("kvtier.engine")

# A store's block table once checked: per group, the device block of each logical block (or None).
BlockTable = Sequence[Sequence[Optional[int]]]
# (group, chunk, key, device blocks) of one chunk a store copies
StoreJob = Tuple[int, int, bytes, List[int]]


class StorePath:
    """Stores for one engine (see the module docstring). ``spill`` is ``None`` without a disk
    tier or with spilling off; ``paused()`` is the pressure monitor's verdict, ``closing()`` the
    engine's; ``spawn`` runs a coroutine as an engine-owned task."""

    def __init__(self, book: HostBook, index: DiskIndex, watch: DurableWatch, spill: Optional[SpillPipeline], *,
                 layout: ModelLayout, config: EngineConfig, device: DeviceKVView, executor: Executor, has_disk: bool,
                 loop: asyncio.AbstractEventLoop, metrics: EngineMetrics, events: EventLog, drop_log: DropLog,
                 spawn: Callable[[Coroutine], asyncio.Task], paused: Callable[[], bool],
                 closing: Callable[[], bool]) -> None:
        self._book = book
        self._index = index
        self._watch = watch
        self._spill = spill
        self._layout = layout
        self._config = config
        self._device = device
        self._executor = executor
        self._has_disk = has_disk
        self._loop = loop
        self._metrics = metrics
        self._events = events
        self._drop_log = drop_log
        self._spawn = spawn
        self._paused = paused
        self._closing = closing
        self.inflight = 0  # chunks whose device -> host copy has not reported yet
        self._admission: Optional[Admission] = None  # made at the first store: the pools exist then

    def _plan(self, keys: RequestKeys, num_tokens: int, block_table: BlockTable):
        """Which chunks to copy, which are already stored or in flight (skipped), which of those
        the handle must still wait for, and whether one of them can never become durable. A
        skipped chunk on the host alone, with a disk tier that evicted it, counts as a use on the
        host."""
        entries, index, layout = self._book.entries, self._index, self._layout
        spill, touch = self._spill, self._book.touch
        jobs: List[StoreJob] = []
        skipped: List[Tuple[int, int]] = []
        wait_for: List[bytes] = []  # skipped chunks whose spill is still to land
        never_durable = False  # a skipped chunk that is neither on disk nor on its way there
        for gi, group in enumerate(layout.groups):
            per_chunk = group.blocks_per_chunk
            table = block_table[gi]
            limit = self._book.num_blocks[gi]
            chunks = retention_store_chunk_indices(layout, gi, num_tokens, self._config.store_retention_interval_tokens)
            group_keys = keys.keys[gi]
            run = bool(chunks) and chunks[-1] - chunks[0] + 1 == len(chunks)  # consecutive (full attention)
            if run:  # one slice of keys, one check of the run's blocks
                chunk_keys: Sequence[bytes] = group_keys[chunks[0] : chunks[-1] + 1]
                checked = valid_store_run(chunks[0], chunks[-1], per_chunk, table, limit)
            else:
                chunk_keys = [group_keys[chunk] for chunk in chunks]
                checked = False
            for chunk, key in zip(chunks, chunk_keys):
                if key in index:
                    skipped.append((gi, chunk))
                    continue
                entry = entries.get(key)
                if entry is not None:
                    skipped.append((gi, chunk))
                    if entry.state in DURABLE_LATER:
                        wait_for.append(key)
                    else:
                        never_durable = True
                        if spill is not None:
                            # On the host only (the disk evicted it): kept there as long as the
                            # chunks stored with it, which one byte LRU would have taken in again.
                            touch(entry)
                    continue
                blocks = (cast(List[int], table[chunk * per_chunk : (chunk + 1) * per_chunk]) if checked  # no None
                          else check_store_blocks(gi, chunk, per_chunk, table, limit))
                jobs.append((gi, chunk, key, blocks))
        return jobs, skipped, wait_for, never_durable

    def _drop_reason(self, count: int) -> Optional[str]:
        if count == 0:
            return None
        if self._paused():
            return "pressure"
        if self.inflight + count > self._config.store_queue_max_chunks:
            return "queue_full"
        return None

    def schedule(self, keys: RequestKeys, num_tokens: int, block_table: BlockTable, ready) -> StoreHandle:
        """Plan the store, take host slots, start the copy; return the handle at once. Arguments
        are already validated by ``OffloadEngine.store``."""
        book, config = self._book, self._config
        jobs, skipped, wait_for, never_durable = self._plan(keys, num_tokens, block_table)

        drop_reason = self._drop_reason(len(jobs))
        allocations: Dict[int, List[int]] = {}
        if drop_reason is None and jobs:
            granted = book.allocate(g for g, _, _, _ in jobs)
            if granted is None:
                drop_reason = "host_full"
            else:
                allocations = granted
        if drop_reason is not None:
            dropped = [(g, c) for g, c, _, _ in jobs]
            self._metrics.dropped(drop_reason, len(dropped))
            self._drop_log.note(drop_reason, len(dropped), drop_detail(
                drop_reason, (g for g, _ in dropped), inflight=self.inflight,
                queue_max_chunks=config.store_queue_max_chunks,
                pool_slots=[p.num_slots for p in book.pools]))
            handle = StoreHandle(self._loop, (), skipped, dropped, drop_reason)
            mark_released(handle)
            mark_durable(handle, False)
            return handle

        handle = StoreHandle(self._loop, [(g, c) for g, c, _, _ in jobs], skipped, (), None)
        if not self._has_disk or never_durable or (jobs and self._spill is None):
            mark_durable(handle, False)
        else:
            self._watch.watch(handle, [k for _, _, k, _ in jobs] + wait_for)
        if not jobs:
            mark_released(handle)
            return handle
        interval = config.store_retention_interval_tokens
        limits = {g: retention_speculative_limit(self._layout, g, num_tokens, interval) if book.pools[g].uses_speculative
                  else 0 for g in {g for g, _, _, _ in jobs}}
        speculative = {(g, c) for g, c, _, _ in jobs if c < limits[g]}
        entries = book.add_entries([(g, c, k) for g, c, k, _ in jobs], HostState.PENDING, allocations, speculative)
        work = [(entry, entry.generation, blocks) for entry, (_, _, _, blocks) in zip(entries, jobs)]
        refused = self._refused(entries)
        self.inflight += len(work)
        copied = self._loop.create_future()
        book.mark_busy([(g, blocks) for g, _, _, blocks in jobs], copied)
        self._spawn(self._run(handle, work, copied, self._start_copy(work, ready), time.perf_counter(), refused))
        return handle

    def _start_copy(self, work, ready) -> "asyncio.Future[object]":
        """Hand the store's copy to the device -> host executor now, not when its task first runs:
        the copy then runs beside the bookkeeping of the stores scheduled after it in the same
        loop turn instead of after all of them. A refused submission (an executor shut down) is
        the copy's failure, reported by the task as any copy error is."""
        book = self._book
        batch = [(e.group_index, blocks, book.view(e)) for e, _, blocks in work]
        try:
            gather = functools.partial(self._device.gather_many_groups, batch, ready_event=ready)
            return self._loop.run_in_executor(self._executor, gather)
        except Exception as exc:  # noqa: BLE001 - reported by _run as the copy's failure
            failed = self._loop.create_future()
            failed.set_exception(exc)
            return failed

    def _refused(self, entries: Sequence[ChunkEntry]) -> FrozenSet[bytes]:
        """The keys of the entries the disk admission refuses (they stay on the host only); decided
        as the store is scheduled, in store order, as replay's fast mode decides."""
        if self._spill is None:
            return frozenset()
        admission = self._admission
        if admission is None:
            capacity = self._config.disk_capacity_bytes
            # A remote tier is fed through the disk tier's writes, and a fleet shares a chunk only
            # once it is there: under a remote every chunk is written, whatever the admission says.
            shared = self._config.remote_url is not None
            admission = self._admission = (AdmitAll() if capacity is None or shared else make_admission(
                self._config.disk_admission,
                *tier_chunks([p.num_slots for p in self._book.pools], capacity, self._book.chunk_nbytes)))
        if isinstance(admission, AdmitAll):  # every store written through: nothing to ask per chunk
            return frozenset()
        answers = admission.decide([e.key for e in entries])
        return frozenset(e.key for e, admit in zip(entries, answers) if not admit)

    def write_back(self, entries: Sequence[ChunkEntry]) -> None:
        """Hand READY host-only entries a load has just hit to the spill: under an admission that
        kept them off the disk, the hit is the reuse it waits for. Nothing when every store is
        written through (then a READY entry off the disk is one the disk refused or failed)."""
        if self._spill is None or not entries or self._admission is None or isinstance(self._admission, AdmitAll):
            return
        for entry in entries:
            self._book.pools[entry.group_index].mark_evictable(entry.slot, False)
        self._spill.enqueue(entries)

    async def _run(self, handle: StoreHandle, work, copied: asyncio.Future, copy: "asyncio.Future[object]",
                   started: float, refused: FrozenSet[bytes] = frozenset()) -> None:
        """The engine-owned task of one store: wait for its copy (``_start_copy``) to end, then
        settle every entry's state and release the caller's device blocks."""
        book = self._book
        error: Optional[BaseException] = None
        try:
            await settle(copy)
        except asyncio.CancelledError:  # only an engine bug cancels its own task; finish the books
            error = ClosedError("store cancelled")
        except Exception as exc:  # the copy failed: nothing it wrote is trusted
            error = exc
            logger.warning("device -> host copy failed: %r", exc)
            self._metrics.worker_error("store_copy")
        self.inflight -= len(work)
        closing = self._closing()
        # Batch by batch, not chunk by chunk: this runs between one copy and the next, and the copy
        # thread waits for the GIL while it does (~2.7 us a chunk done one call at a time).
        book.unpin_all([entry for entry, _, _ in work])
        done: List[ChunkEntry] = []
        for entry, generation, _ in work:
            if entry.generation != generation or entry.dead:
                continue
            if error is not None or closing:
                reason = "copy_error" if error is not None else "closed"
                book.drop(entry, reason)
                book.resolve(entry, reason)
                continue
            done.append(entry)
        if self._spill is not None:
            self._spill.enqueue(e for e in done if e.key not in refused)
        host_only = done if self._spill is None else [e for e in done if e.key in refused]
        book.settle_ready_all(host_only)
        for entry in host_only:
            self._watch.resolve(entry.key, False)
        for entry in done:
            book.resolve(entry, None)
        self._events.extend("stored", done, "host")
        if done:
            chunk_nbytes = book.chunk_nbytes
            nbytes = sum(chunk_nbytes[e.group_index] for e in done)
            self._metrics.stored("host", len(done), nbytes)
            self._metrics.latency("host", "store", time.perf_counter() - started)
        if not copied.done():
            copied.set_result(None)
        mark_released(handle)
        if error is not None or closing:
            self._watch.finish(handle, False)
