"""The store path: device blocks -> host slots, then handed to the spill pipeline.

Primitives: ``StorePath`` (``schedule`` one request's store, ``inflight`` chunks whose copy has not
reported yet). Event-loop thread; the copy runs on the engine's device -> host thread (the CPU
stand-in for the CUDA d2h stream), ordered after the event ``OffloadEngine.store`` took at call time.

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
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from kvtier.errors import ClosedError
from kvtier.policy.retention import retention_speculative_limit, retention_store_chunk_indices

from .drop_log import drop_detail
from .lifecycle import DURABLE_LATER, HostState
from .records import ChunkEntry, RequestKeys, StoreHandle
from .tasks import settle

if TYPE_CHECKING:  # pragma: no cover
    from .engine import OffloadEngine

__all__ = ["StorePath"]

logger = logging.getLogger("kvtier.engine")

# (group, chunk, key, device blocks) of one chunk a store copies
StoreJob = Tuple[int, int, bytes, List[int]]


class StorePath:
    """Stores for one engine (see the module docstring)."""

    def __init__(self, engine: "OffloadEngine") -> None:
        self._engine = engine
        self.inflight = 0  # chunks whose device -> host copy has not reported yet

    def _plan(self, keys: RequestKeys, num_tokens: int, block_table: Sequence[Sequence[int]]):
        """Which chunks to copy, which are already stored or in flight (skipped), which of those
        the handle must still wait for, and whether one of them can never become durable."""
        engine = self._engine
        jobs: List[StoreJob] = []
        skipped: List[Tuple[int, int]] = []
        wait_for: List[bytes] = []  # skipped chunks whose spill is still to land
        never_durable = False  # a skipped chunk that is neither on disk nor on its way there
        for gi, group in enumerate(engine.layout.groups):
            per_chunk = group.blocks_per_chunk
            table = block_table[gi]
            for chunk in retention_store_chunk_indices(
                engine.layout, gi, num_tokens, engine.config.store_retention_interval_tokens
            ):
                key = keys.keys[gi][chunk]
                entry = engine._entries.get(key)
                if entry is not None or key in engine._index:
                    skipped.append((gi, chunk))
                    if key in engine._index:
                        continue
                    if entry.state in DURABLE_LATER:
                        wait_for.append(key)
                    else:
                        never_durable = True
                    continue
                first = chunk * per_chunk
                if len(table) < first + per_chunk:
                    raise ValueError(
                        f"block_table[{gi}] has {len(table)} blocks; chunk {chunk} needs blocks "
                        f"{first}..{first + per_chunk - 1}"
                    )
                blocks = [int(b) for b in table[first : first + per_chunk]]
                engine._check_device_blocks(gi, blocks)
                jobs.append((gi, chunk, key, blocks))
        return jobs, skipped, wait_for, never_durable

    def _drop_reason(self, count: int) -> Optional[str]:
        engine = self._engine
        if count == 0:
            return None
        if engine._pressure is not None and engine._pressure.paused:
            return "pressure"
        if self.inflight + count > engine.config.store_queue_max_chunks:
            return "queue_full"
        return None

    def schedule(self, keys: RequestKeys, num_tokens: int, block_table: Sequence[Sequence[int]], ready) -> StoreHandle:
        """Plan the store, take host slots, start the copy; return the handle at once. Arguments
        are already validated by ``OffloadEngine.store``."""
        engine = self._engine
        jobs, skipped, wait_for, never_durable = self._plan(keys, num_tokens, block_table)

        drop_reason = self._drop_reason(len(jobs))
        allocations: Optional[Dict[int, List[int]]] = {}
        if drop_reason is None and jobs:
            allocations = engine._allocate_slots(g for g, _, _, _ in jobs)
            if allocations is None:
                drop_reason = "host_full"
        if drop_reason is not None:
            dropped = [(g, c) for g, c, _, _ in jobs]
            engine.metrics.dropped(drop_reason, len(dropped))
            engine._drop_log.note(drop_reason, len(dropped), drop_detail(
                drop_reason, (g for g, _ in dropped), inflight=self.inflight,
                queue_max_chunks=engine.config.store_queue_max_chunks,
                pool_slots=[p.num_slots for p in engine._pools]))
            handle = StoreHandle(engine._loop, (), skipped, dropped, drop_reason)
            handle._mark_released()
            handle._mark_durable(False)
            return handle

        handle = StoreHandle(engine._loop, [(g, c) for g, c, _, _ in jobs], skipped, (), None)
        spill_on = engine._disk is not None and engine.config.spill_enabled
        if engine._disk is None or never_durable or (jobs and not spill_on):
            handle._mark_durable(False)
        else:
            engine._spill.watch.watch(handle, [k for _, _, k, _ in jobs] + wait_for)
        if not jobs:
            handle._mark_released()
            return handle
        interval = engine.config.store_retention_interval_tokens
        limits = {g: retention_speculative_limit(engine.layout, g, num_tokens, interval) if engine._pools[g].uses_speculative
                  else 0 for g in {g for g, _, _, _ in jobs}}
        speculative = {(g, c) for g, c, _, _ in jobs if c < limits[g]}
        entries = engine._new_entries([(g, c, k) for g, c, k, _ in jobs], HostState.PENDING, allocations, speculative)
        work = [(entry, entry.generation, blocks) for entry, (_, _, _, blocks) in zip(entries, jobs)]
        self.inflight += len(work)
        copied = engine._loop.create_future()
        engine._mark_busy([(e.group_index, b) for e, _, blocks in work for b in blocks], copied)
        engine._spawn(self._run(handle, work, copied, ready))
        return handle

    async def _run(self, handle: StoreHandle, work, copied: asyncio.Future, ready) -> None:
        """The engine-owned copy task of one store: gather, then settle every entry's state."""
        engine = self._engine
        started = time.perf_counter()
        batch = [(e.group_index, blocks, engine._pools[e.group_index].view(e.slot)) for e, _, blocks in work]
        error: Optional[BaseException] = None
        try:
            gather = functools.partial(engine.device.gather_many_groups, batch, ready_event=ready)
            await settle(engine._loop.run_in_executor(engine._d2h, gather))
        except asyncio.CancelledError:  # only an engine bug cancels its own task; finish the books
            error = ClosedError("store cancelled")
        except Exception as exc:  # the copy failed: nothing it wrote is trusted
            error = exc
            logger.warning("device -> host copy failed: %r", exc)
            engine.metrics.worker_error("store_copy")
        self.inflight -= len(work)
        nbytes = 0
        spill_on = engine._disk is not None and engine.config.spill_enabled
        done: List[ChunkEntry] = []
        for entry, generation, _ in work:
            engine._unpin(entry)
            if entry.generation != generation or entry.dead:
                continue
            if error is not None or engine._closing:
                reason = "copy_error" if error is not None else "closed"
                engine._drop_entry(entry, reason)
                engine._resolve_ready(entry, reason)
                continue
            nbytes += engine._chunk_nbytes[entry.group_index]
            done.append(entry)
        if spill_on:
            engine._spill.enqueue(done)
        for entry in done:
            if not spill_on:
                engine._settle_ready(entry)
                engine._spill.watch.resolve(entry.key, False)
            engine._resolve_ready(entry, None)
            engine._events.append("stored", entry.key, entry.group_index, "host")
        if nbytes:
            engine.metrics.stored("host", len(done), nbytes)
            engine.metrics.latency("host", "store", time.perf_counter() - started)
        if not copied.done():
            copied.set_result(None)
        handle._mark_released()
        if error is not None or engine._closing:
            engine._spill.watch.finish(handle, False)
