"""Write-behind to the disk tier, and which store handles wait for which chunks to get there.

Primitives: ``SpillPipeline`` (the queue of QUEUED chunks, the loop that writes them in batches,
``enqueue`` / ``drain`` / ``wake``); it resolves the keys of a ``DurableWatch`` (``durable.py``)
as their puts land. Event-loop thread only; the tier does its blocking work on its own
threads.

Rules this module keeps:

- a chunk's host slot becomes evictable only once its chunk is on disk, or once the engine gave up
  writing it (a failed put: the drop is counted, the host copy stays usable until evicted);
- *any* exception from the tier is a failed batch: logged, counted, nothing marked durable or
  indexed (a foreign ``ValueError`` from a codec used to be reported durable);
- a handle resolves durable only when every chunk it waits for was added to the disk index by a
  put that no later removal overtook (``DiskIndex.add``);
- a queued chunk whose key reached the disk another way (another process, found by a refresh) is
  settled as durable, not silently dropped;
- the loop is supervised by the engine: a crash restarts it, repeated crashes fail the engine.

Up to ``BATCHES_IN_FLIGHT`` batches are in flight at once, so the disk tier encodes the next batch
on its pool while its writer thread commits the previous one; awaiting one batch at a time left
the disk idle during every encode. Four, not two: with two, the third batch reached the tier only
once the first was acknowledged, so the disk idled through two index commits and the next batch's
staging (measured: 1.1 GB/s with two in flight, 1.5-1.9 GB/s with four, 1 MiB chunks); four is the
LMDB tier's ``writes.STAGED_GROUPS``, what its writer stages at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Deque, Iterable, List, Optional, Set, Tuple

from kvtier.tiers.base import ChunkTier

from .config import EngineConfig
from .disk_index import DiskIndex
from .durable import DurableWatch
from .events import EventLog
from .host_book import HostBook
from .lifecycle import HostState, move
from .metrics import EngineMetrics
from .pressure import LatencyEwma
from .records import ChunkEntry
from .tasks import settle

__all__ = ["SpillPipeline", "BATCHES_IN_FLIGHT"]

logger = logging.getLogger("kvtier.engine")

BATCHES_IN_FLIGHT = 4


class SpillPipeline:
    """The spill queue and its loop, for one engine (see the module docstring): chunks of
    ``book`` go to ``tier``, land in ``index`` and
    resolve ``watch``; ``closing()`` tells the loop to return once the queue is drained;
    ``write_latency`` hears each batch's service time (the pressure monitor's disk signal)."""

    def __init__(self, book: HostBook, tier: ChunkTier, index: DiskIndex, watch: DurableWatch, *,
                 config: EngineConfig, metrics: EngineMetrics, events: EventLog, write_latency: LatencyEwma,
                 closing: Callable[[], bool]) -> None:
        self._book = book
        self._tier = tier
        self._index = index
        self._config = config
        self._metrics = metrics
        self._events = events
        self._write_latency = write_latency
        self._closing = closing
        self.queue: Deque[ChunkEntry] = deque()
        self.watch = watch
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight: Set[asyncio.Task] = set()
        self._last_done = 0.0  # perf_counter() when the last batch finished

    # -- the engine's side -----------------------------------------------------------------------

    def enqueue(self, entries: Iterable[ChunkEntry]) -> None:
        for entry in entries:
            move(entry, HostState.QUEUED)
            self.queue.append(entry)
        if self.queue:
            self._idle.clear()
            self._wakeup.set()

    @property
    def idle(self) -> bool:
        return not self.queue and not self._in_flight and self._idle.is_set()

    async def drain(self) -> None:
        """Wait until the queue is empty and no batch is in flight. Cancelling the wait stops
        nothing."""
        while not self.idle:
            self._wakeup.set()
            await self._idle.wait()
            await asyncio.sleep(0)

    def wake(self) -> None:
        self._wakeup.set()

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        """The spill loop (supervised by the engine). Returns once the engine is closing and the
        queue is drained."""
        in_flight = self._in_flight
        try:
            while True:
                if self.queue and len(in_flight) < BATCHES_IN_FLIGHT:
                    batch, batch_bytes = self._next_batch()
                    if batch:
                        in_flight.add(asyncio.get_running_loop().create_task(self._write(batch, batch_bytes)))
                    continue
                if not self.queue and not in_flight:
                    self._idle.set()
                    if self._closing():
                        return
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                # Pipeline full, or nothing queued while batches are in flight: wait for either.
                wakeup = asyncio.get_running_loop().create_task(self._wakeup.wait())
                try:
                    finished, _ = await asyncio.wait([wakeup, *in_flight], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wakeup.cancel()
                self._wakeup.clear()
                for task in finished:
                    if task is wakeup:
                        continue
                    in_flight.discard(task)
                    task.result()  # _write handles every exception of the tier; anything else is a bug
        finally:
            # A crash (or the loop's own cancellation) must not orphan batches: they settle on
            # their own, and the restarted loop finds the rest of the queue.
            for task in list(in_flight):
                task.add_done_callback(in_flight.discard)

    def _next_batch(self) -> Tuple[List[ChunkEntry], int]:
        """Take the next batch off the queue: up to ``spill_batch_max_chunks`` chunks and
        ``spill_batch_max_bytes`` bytes (at least one chunk). A queued chunk already on disk (another
        writer put it there) is settled at once as durable."""
        config = self._config
        chunk_nbytes = self._book.chunk_nbytes
        batch: List[ChunkEntry] = []
        batch_bytes = 0
        while self.queue and len(batch) < config.spill_batch_max_chunks:
            entry = self.queue[0]
            size = chunk_nbytes[entry.group_index]
            if batch and batch_bytes + size > config.spill_batch_max_bytes:
                break
            self.queue.popleft()
            if entry.dead or entry.state is not HostState.QUEUED:
                continue
            if entry.key in self._index:
                self._book.settle_ready(entry)
                self.watch.resolve(entry.key, True)
                continue
            batch.append(entry)
            batch_bytes += size
        return batch, batch_bytes

    async def _write(self, batch: List[ChunkEntry], batch_bytes: int) -> None:
        book = self._book
        items = []
        for entry in batch:
            move(entry, HostState.SPILLING)
            book.pin(entry)
            items.append((entry.key, book.chunk_meta(entry), book.buffer(entry)))
        started = time.perf_counter()
        error: Optional[BaseException] = None
        sequence: Optional[int] = None
        token = self._index.begin()
        try:
            answer = await settle(self._tier.put_many(items))
            if isinstance(answer, int) and not isinstance(answer, bool):
                sequence = answer
        except asyncio.CancelledError:
            error = asyncio.CancelledError()
            raise
        except Exception as exc:  # any exception: a third-party tier or codec is no exception
            error = exc
            logger.warning("spill of %d chunks failed: %r", len(batch), exc)
            self._metrics.worker_error("spill")
        finally:
            finished = time.perf_counter()
            # Batches are pipelined: one may wait for the batch committed before it, so its own
            # service time starts when that one finished (else the latency signal, and pressure,
            # would double whenever two batches are in flight).
            elapsed = finished - max(started, self._last_done)
            self._last_done = finished
            self._write_latency.observe(elapsed)
            self._settle(batch, batch_bytes, token, sequence, error, elapsed)

    def _settle(self, batch, batch_bytes: int, token: int, sequence: Optional[int], error, elapsed: float) -> None:
        index = self._index
        for entry in batch:
            self._book.unpin(entry)
            if not entry.dead:
                # On disk, or deliberately droppable after a failed spill: either way settled.
                self._book.settle_ready(entry)
            # A write the tier already removed again (an eviction that overtook the answer) is not
            # indexed, and its handles are not durable.
            ok = error is None and index.add(entry.key, token, sequence)
            if ok:
                self._events.append("stored", entry.key, entry.group_index, "disk")
            self.watch.resolve(entry.key, ok)
        index.end(token)
        if error is None:
            self._metrics.stored("disk", len(batch), batch_bytes)
            self._metrics.latency("disk", "put", elapsed)
        else:
            self._metrics.dropped("tier_error", len(batch))
