"""The asyncio offload engine: what a serving process embeds.

Primitives: ``OffloadEngine`` (store / lookup / load / prefetch / fence / flush / close /
statistics / take_events / check / check_disk). Its errors live in ``kvtier.errors``.

Threads. Every state change happens on the event-loop thread that started the engine (a call from
another loop or thread raises ``EngineUsageError``, from a forked child ``ForkedProcessError``,
before anything is scheduled).
Blocking work runs elsewhere and only reports back: device -> host copies on one copy thread, host
-> device copies on another (two each on CUDA, queueing on kvtier's two copy streams), disk I/O on the disk
tier's own threads. One executor hop per batch of chunks, never per chunk.

Layout. A chunk's life is one transition table (``lifecycle.py``); entries, host pools, pins and
fences have one owner, the ``HostBook`` (``host_book.py``); the disk half (opening the disk and the
remote, removals, refresh, the ordered ``DiskIndex`` of which keys the disk holds) is the
``DiskStore`` (``store.py``); which handles wait for which spills is the ``DurableWatch``
(``durable.py``); write-behind is the ``SpillPipeline`` (``spill.py``); stores are the
``StorePath`` (``storing.py``); loads and promotions are the ``LoadPath`` (``loading.py``);
waiting on engine-owned work and keeping background loops alive is ``tasks.py``. ``start`` builds
them (``wiring.py``: host pools, paths, pressure monitor, background loops) and hands each the
collaborators it needs (none of them imports this module); who may call is ``caller.py``. This
module holds the public calls: it checks their arguments once (``validation.py``) and passes them on.

Work the engine starts (a store's copy, a load, a promotion, a spill) runs in engine-owned tasks
that no caller's cancellation reaches: a public coroutine cancels only its own wait. Pins
(reference counts) keep a slot from eviction or release while any copy reads or writes it; an
abandoned copy (timeout) bumps the entry's generation so its late completion is discarded and only
then frees the slot. Any exception at a worker boundary (not only ``KvtierError``) fails that work,
is logged and counted (``kvtier_worker_errors_total``), and leaves the tables consistent.

Streams (CUDA). ``store`` and ``load`` take their order when called: an event recorded then on
``compute_stream=`` (default: the caller's current stream) or the caller's ``ready_event=``; their
copies, on kvtier's own streams, wait for it only, not for later compute. ``load`` returns once its
copies completed. Do not free the KV tensors while a copy is queued (``fence`` first): torch's
caching allocator is told of the copy streams, memory outside it (vLLM's sleep mode) is not.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from kvtier.errors import (
    ClosedError,
    EngineInvariantError,
    KvtierError,
    TierIOError,
)
from kvtier.policy import KeyChain, ModelLayout, longest_hit
from kvtier.policy.retention import check_retention_interval
from kvtier.tiers.base import ChunkTier
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.host import HostSlabPool

from .caller import CallerGuard
from .config import EngineConfig
from .disk_index import DiskIndex
from .drop_log import DropLog
from .durable import DurableWatch
from .events import EventLog
from .host_book import HostBook
from .lifecycle import LEGACY_NAME, HostState
from .loading import LoadPath
from .metrics import EngineMetrics
from .pressure import LatencyEwma, PressureMonitor
from .records import ChunkEvent, LoadResult, RequestKeys, StoreHandle, mark_durable, mark_released
from .spill import SpillPipeline
from .store import DiskStore
from .storing import StorePath
from .tasks import Supervised, wait_all
from .validation import (check_count, check_device_kind, check_engine_settings, check_fence_arguments,
                         check_load_arguments, check_prefetch_policy, check_request_keys, check_store_arguments,
                         check_token_ids)
from .wiring import PoolsFactory, build_paths, make_host_pools, pressure_monitor, refresh_loop, start_loop

__all__ = ["OffloadEngine", "EngineInvariantError"]

logger = logging.getLogger("kvtier.engine")

TokensOrKeys = Union[Sequence[int], RequestKeys]
BlockTable = Sequence[Sequence[int]]

class OffloadEngine:
    """Keeps a model's KV chunks in host memory and on disk, and brings them back on a prefix hit.

    Use as an async context manager::

        async with OffloadEngine(layout, device_view, config, fingerprint=fp) as engine:
            handle = engine.store(token_ids, block_table)          # returns at once
            await handle.wait_released()                           # device blocks reusable
            hit = engine.lookup(other_ids)                         # never blocks; None = ask again
            if hit: await engine.load(other_ids, hit, other_table) # fills the device blocks

    ``fingerprint`` binds every key to the model layout (see ``kvtier.policy.layout_fingerprint``);
    a per-request ``salt`` separates tenants. ``disk_tier`` overrides the LMDB tier that
    ``config.cache_dir`` would open (for example a ``FileTier``); ``pressure_sources`` overrides the
    NVML and host-memory sources of the pressure monitor; ``host_pools`` makes the host pools
    instead of ``pools_for_budget`` over ``config.host_capacity_bytes``: called on a worker thread
    as ``host_pools(chunk_bytes, device_kind=..., eviction=...)`` with each group's chunk bytes, it
    returns one ``HostSlabPool`` per group (the checks of device kind and page-locking still apply).
    ``host`` is the host-side bookkeeping (``HostBook``), for inspection and self-checks.
    """

    def __init__(
        self,
        layout: ModelLayout,
        device: DeviceKVView,
        config: Optional[EngineConfig] = None,
        *,
        fingerprint: Union[bytes, str],
        disk_tier: Optional[ChunkTier] = None,
        pressure_sources: Optional[Mapping[str, Callable[[], Optional[float]]]] = None,
        host_pools: Optional[PoolsFactory] = None,
    ) -> None:
        if not isinstance(layout, ModelLayout):
            raise TypeError(f"layout must be a ModelLayout, got {type(layout).__name__}")
        if not isinstance(device, DeviceKVView):
            raise TypeError(f"device must be a DeviceKVView, got {type(device).__name__}")
        if not fingerprint:
            raise ValueError("fingerprint must not be empty")
        self.layout = layout
        self.device = device
        self.config = config if config is not None else EngineConfig()
        self.fingerprint = fingerprint.encode() if isinstance(fingerprint, str) else bytes(fingerprint)
        check_engine_settings(self.config, layout, device)
        check_retention_interval(layout, self.config.store_retention_interval_tokens)
        self.metrics = EngineMetrics()
        self._drop_log = DropLog()
        # The disk half: the tier, the remote behind it, and the index of which keys they hold.
        self._store = DiskStore(self.config.store, fingerprint=self.fingerprint, tier=disk_tier,
                                on_removed=self._index_removed,
                                on_evicted=lambda count: self.metrics.evicted("disk", count),
                                on_error=self.metrics.worker_error)
        self._owns_disk = disk_tier is None
        self._pressure_sources = pressure_sources
        self._pressure: Optional[PressureMonitor] = None
        self._write_latency = LatencyEwma(alpha=0.2, high_latency_s=1.0)
        self._guard = CallerGuard()
        self._host_pools = host_pools
        self._events = EventLog(self.config.events_max, on_drop=self.metrics.events_dropped)
        self._index = self._store.index
        self._watch = DurableWatch()
        groups = range(len(layout.groups))
        self.host = HostBook(
            self.fingerprint, [device.chunk_nbytes(g) for g in groups], [device.num_blocks(g) for g in groups],
            [(str(device.chunk_dtype(g)).replace("torch.", ""), tuple(device.chunk_shape(g))) for g in groups],
            index=self._index, watch=self._watch, metrics=self.metrics, events=self._events)
        # Built by start(), once the executors, the host pools and the disk tier exist.
        self._spill: Optional[SpillPipeline] = None
        self._stores: Optional[StorePath] = None
        self._loads: Optional[LoadPath] = None
        self._spill_runner: Optional[Supervised] = None
        self._refresh_runner: Optional[Supervised] = None
        # The host pools being made by start(), and the task that wires them once made.
        self._pools_made: "Optional[asyncio.Future[List[HostSlabPool]]]" = None
        self._wiring: "Optional[asyncio.Task[None]]" = None
        self._tasks: set = set()
        # Two threads per direction on CUDA, so batch n+1 queues while batch n's thread waits on
        # its event (``DeviceBackend.copy_workers``). An executor starts its threads at its first
        # copy, not here.
        workers = device.backend.copy_workers
        self._d2h = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-d2h")
        self._h2d = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-h2d")
        self._started = False
        self._closing = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "OffloadEngine":
        try:
            await self.start()
        except BaseException:
            # `async with` never calls __aexit__ when __aenter__ fails: release what start() took
            # (threads, slabs, the disk tier it opened) here, or they outlive the failed start.
            try:
                await self.close()
            except Exception:
                logger.exception("closing the engine after a failed start failed")
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Start making the host slabs (on a worker thread), open the disk tier and start listing
        its keys into the disk index (waiting for the listing at most ``disk_index_wait_s``);
        once the slabs exist, build the store, load and spill paths and start the pressure
        monitor. Waits for the slabs when ``host_capacity_bytes`` is at most
        ``host_pools_wait_bytes``; else, until they exist (seconds for tens of GiB)
        the engine serves, answering every ``lookup`` with 0 and dropping every ``store``, both
        counted as ``"starting"`` (a serving loop must not wait on a cache). A slab that fails
        after start returned fails the engine (``_fail``: it refuses new work, loudly); ``flush``
        waits for the slabs and the listing. Cancelling it leaves the engine unusable; call
        ``close``."""
        if self._started:
            raise RuntimeError("OffloadEngine.start() called twice")
        self._started = True
        self._guard.bind()
        config = self.config
        check_device_kind(config.device_kind, self.device)  # a wrong setting fails here, not later
        # Off the loop and not waited for: pre-faulting (and on CUDA registering) a slab takes
        # seconds for tens of GiB.
        self._pools_made = asyncio.ensure_future(asyncio.to_thread(
            make_host_pools, config, self.device, self.host.chunk_nbytes, self._host_pools))
        if self._owns_disk and config.remote_url is not None:
            if config.disk_index_refresh_interval_s is None:
                logger.warning("remote tier without disk_index_refresh_interval_s: chunks other hosts write become "
                               "hits here only after a restart (set it, e.g. 10 s)")
            self.metrics.set_tier_statistics(self._store.statistics)
        # Open (verified, a damaged cache_dir moved aside), chain the remote, subscribe to
        # removals, list into the index; a listing that fails leaves the index empty (logged) and
        # the engine serving: the disk's chunks are misses until the next start.
        await self._store.start()
        if config.host_capacity_bytes <= config.host_pools_wait_bytes:
            await asyncio.wait({self._pools_made})
        if self._pools_made.done():
            await self._wire(self._pools_made.result())  # a slab that failed fails start, as before
        else:
            self._wiring = asyncio.ensure_future(self._wire_when_made(self._pools_made))

    async def _wire_when_made(self, made: "asyncio.Future[List[HostSlabPool]]") -> None:
        """The rest of ``start`` once the host pools exist (a task on the loop). A close meanwhile:
        the pools are only taken, for close to release."""
        try:
            pools = await asyncio.shield(made)
        except Exception as exc:
            logger.error("kvtier engine: making the host pools failed: %r", exc)
            self._fail(exc)
            return
        if self._closing:
            self.host.open(pools)
            return
        try:
            await self._wire(pools)
        except Exception as exc:  # nobody awaits this task: the engine fails loudly instead
            logger.exception("kvtier engine: wiring the host pools failed")
            self._fail(exc)

    async def _wire(self, pools: "List[HostSlabPool]") -> None:
        config = self.config
        self.host.open(pools)
        self.metrics.set_state_counts(self.host.state_counts)
        closing = lambda: self._closing  # noqa: E731 - read when asked, not now
        self._spill, self._stores, self._loads = build_paths(
            self.host, self._disk, self._index, self._watch, config=config, layout=self.layout, device=self.device,
            metrics=self.metrics, events=self._events, write_latency=self._write_latency, drop_log=self._drop_log,
            spawn=self._spawn, closing=closing, paused=self._paused, d2h=self._d2h, h2d=self._h2d)
        if self._spill is not None and config.spill_enabled:
            self._spill_runner = start_loop("spill", self._spill.run, metrics=self.metrics, closing=closing,
                                            on_give_up=self._fail)
        if self._disk is not None and config.disk_index_refresh_interval_s is not None:
            interval = config.disk_index_refresh_interval_s
            self._refresh_runner = start_loop(
                "disk-index", lambda: refresh_loop(interval, self.refresh_disk_index, metrics=self.metrics,
                                                   closing=closing), metrics=self.metrics, closing=closing,
                on_give_up=self._fail)
        self._pressure = pressure_monitor(config, self.device, self._pressure_sources,
                                          own_bytes=self.host.slab_bytes, write_latency=self._write_latency)
        self.metrics.watch_pressure(self._paused)
        await self._pressure.start()

    def _paused(self) -> bool:
        return self._pressure is not None and self._pressure.paused

    def _fail(self, exc: BaseException) -> None:
        """A background loop crashed for good: the engine refuses new work, loudly, and every
        handle still waiting for the disk resolves ``False``."""
        self._guard.failure = exc
        logger.critical("kvtier engine failed: a background loop keeps crashing (%r); closing is all that is left", exc)
        self._watch.fail_all()

    @property
    def _disk(self) -> Optional[ChunkTier]:
        # The tier the store, load and spill paths read and write (the store's; None without one).
        return self._store.tier

    @property
    def quarantined_cache_dir(self) -> Optional[str]:
        """Where ``start`` moved a damaged ``cache_dir`` (``None`` when it did not)."""
        return self._store.quarantined_cache_dir

    @property
    def closed(self) -> bool:
        """True once ``close`` finished."""
        return self._closed

    @property
    def closing(self) -> bool:
        """True from the moment ``close`` was called."""
        return self._closing

    # ------------------------------------------------------------------ the disk index

    @property
    def disk_index(self) -> DiskIndex:
        """Which keys the engine believes the disk tier holds (read-only use; see ``DiskIndex``)."""
        return self._index

    def _index_removed(self, key: bytes) -> None:
        entry = self.host.entries.get(key)
        self._events.append("removed", key, entry.group_index if entry is not None else -1, "disk")

    async def refresh_disk_index(self) -> Tuple[int, int]:
        """Re-read which chunks the disk tier holds, for a cache directory another process writes
        (a warmup beside a serving process). Returns (keys added, keys removed).

        Keys this engine spills while the listing runs are kept; keys indexed before the listing
        began and absent from it leave the index; a key the tier reports removed while the listing
        ran stays out (``DiskIndex.refresh``). A tier failure is a ``TierIOError`` (a foreign exception
        from the tier is its ``__cause__``) and leaves the index as it was. Queued spills of keys that turn out to be on disk
        already are settled as durable by the spill pipeline. Cancelling the call leaves the index
        as it was."""
        self._check_open()
        added, removed = await self._store.refresh()
        if added and self._spill is not None and self._spill.queue:
            self._spill.wake()
        return added, removed

    async def check_disk(self) -> None:
        """Compare the disk index with the tier: every indexed key must be on the tier (else
        ``lookup`` admits a hit that ``load`` fails), and the tier's own ``check()`` must pass.
        Raises ``EngineInvariantError`` listing each problem. Meant for an idle engine (test
        teardown, end of stress runs). Cancelling the call drops the answer only."""
        self._check_started()
        problems = await self._store.problems()
        if problems:
            raise EngineInvariantError("; ".join(problems))

    # ------------------------------------------------------------------ close

    async def close(self) -> None:
        """Stop accepting work, let the work in flight finish (copies cannot be interrupted; queued
        spills are written), fail the durable waits left with ``False``, close the host pools and
        the disk tier it opened. Safe to call twice. Cancelling ``close`` cancels its wait only: the
        engine stays closing and its work runs on; call it again to finish. A tier call that never
        returns (a stalled disk) keeps ``close`` waiting: a tier may still write into a host slot
        until it returns (the buffer rule), so the slab cannot be released before."""
        if self._closed:
            return
        if self._started:
            self._check_caller(failed_ok=True)
        self._closing = True
        if self._wiring is not None:  # ends once the pools exist (a worker thread cannot be stopped)
            await asyncio.wait({self._wiring})
        elif self._pools_made is not None:  # start failed or was cancelled before it wired them
            made = self._pools_made
            await asyncio.wait({made})
            if not made.cancelled() and made.exception() is None and not self.host.pools:
                self.host.open(made.result())
        if self._refresh_runner is not None:
            self._refresh_runner.cancel()
            await self._refresh_runner.wait()
        if self._spill_runner is not None and self._spill is not None:
            self._spill.wake()
            await self._spill_runner.wait()
        while any(not t.done() for t in self._tasks):
            await wait_all([t for t in self._tasks if not t.done()])
        self._watch.fail_all()
        if self._pressure is not None:
            await self._pressure.stop()
        await self._store.close()  # the tiers it opened; a disk_tier passed in stays open
        for executor in (self._d2h, self._h2d):
            if executor is not None:
                executor.shutdown(wait=True)
        self.host.close()
        self.metrics.watch_pressure(None)
        self._closed = True

    def _check_open(self) -> None:
        if self._closing or self._closed:
            raise ClosedError("the offload engine is closed")
        if not self._started:
            raise ClosedError("the offload engine is not started: use `async with OffloadEngine(...)`")
        self._check_caller()

    def _paths(self) -> Tuple[StorePath, LoadPath]:
        """``_check_open``, and the store and load paths ``start`` built."""
        self._check_open()
        if self._stores is None or self._loads is None:
            raise ClosedError("the offload engine did not finish starting; close it")
        return self._stores, self._loads

    @property
    def _starting(self) -> bool:
        # True while start's host pools are still being made (serving misses meanwhile).
        return self._wiring is not None and not self._wiring.done()

    @property
    def starting(self) -> bool:
        """True while the engine, started, still makes its host pools: lookups answer 0 and stores
        are dropped (both counted as ``"starting"``)."""
        return self._starting

    def _dropped_starting(self, num_tokens: int) -> StoreHandle:
        """The handle of a store while the host pools are being made: the request's complete chunks
        dropped, released and not durable at once."""
        dropped = [(g, c) for g, group in enumerate(self.layout.groups)
                   for c in range(num_tokens // group.tokens_per_chunk)]
        self.metrics.dropped("starting", len(dropped))
        handle = StoreHandle(asyncio.get_running_loop(), (), (), dropped, "starting")
        mark_released(handle)
        mark_durable(handle, False)
        return handle

    def _check_caller(self, failed_ok: bool = False) -> None:
        self._guard.check(failed_ok)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)  # the engine's loop: _check_caller made sure
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ keys

    def request_keys(self, token_ids: Sequence[int], *, salt: Union[bytes, str, None] = None) -> RequestKeys:
        """The request's chunk keys, each hashed when first read; pass the result to store/lookup/load,
        and grow it by a decode step's new tokens with ``RequestKeys.extended`` (O(new tokens))."""
        token_ids = check_token_ids(token_ids)
        return RequestKeys.from_chain(KeyChain(self.layout, token_ids, fingerprint=self.fingerprint, salt=salt))

    def _keys(self, request: TokensOrKeys, salt) -> RequestKeys:
        if isinstance(request, RequestKeys):
            if salt is not None:
                raise ValueError("salt is bound when the RequestKeys are made; do not pass it again")
            check_request_keys(request, self.layout)
            return request
        return self.request_keys(request, salt=salt)

    # ------------------------------------------------------------------ store

    def store(
        self,
        request: TokensOrKeys,
        block_table: BlockTable,
        num_tokens: Optional[int] = None,
        *,
        salt: Union[bytes, str, None] = None,
        compute_stream: Any = None,
        ready_event: Any = None,
    ) -> StoreHandle:
        """Schedule the store of a request's chunks and return at once.

        ``block_table[g][i]`` is the device block of logical block ``i`` of group ``g``;
        ``num_tokens`` (default: all tokens of the request) is how many tokens are final.
        Full-attention groups store every complete chunk; sliding-window groups only the chunks
        ``reachable_store_block_mask`` selects (MTP-widened), thinned by
        ``store_retention_interval_tokens``. Chunks already stored or in flight are skipped; the
        handle is durable only once those are on disk too. Under memory pressure, a full store
        queue or a full host pool, the new chunks are dropped and counted, never waited for. The
        caller must not overwrite the device blocks before ``handle.wait_released()`` (or
        ``fence``). The copy is ordered after ``ready_event``, else after the work queued so far on
        ``compute_stream`` (default: the calling thread's current CUDA stream; module docstring).
        """
        self._check_open()
        keys = self._keys(request, salt)
        num_tokens, rows = check_store_arguments(self.layout, keys.num_tokens, num_tokens, block_table)
        if self._starting:
            return self._dropped_starting(num_tokens)
        stores, _ = self._paths()
        return stores.schedule(keys, num_tokens, rows, self.device.backend.ready_event(compute_stream, ready_event))

    async def flush(self) -> None:
        """Wait until every operation started so far has finished: the rest of start (the host
        pools, the listing of the disk's keys), device copies of stores, their spills (with a disk
        tier), loads and prefetch reads. Cancelling the wait stops nothing."""
        self._check_started()
        self._check_caller(failed_ok=True)
        if self._wiring is not None and not self._wiring.done():
            await asyncio.wait({self._wiring})
        await self._store.wait_listed()
        while True:
            # Done tasks leave _tasks in a done-callback, a loop iteration later: wait only for the
            # running ones, or this loop would spin without ever yielding.
            running = [t for t in self._tasks if not t.done()]
            if running:
                await wait_all(running)
                continue
            spill, runner = self._spill, self._spill_runner
            if spill is not None and runner is not None and not runner.done.is_set() and not spill.idle:
                await spill.drain()
                continue
            return

    def _check_started(self) -> None:
        if not self._started:
            raise ClosedError("the offload engine is not started")

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        request: TokensOrKeys,
        max_tokens: Optional[int] = None,
        *,
        salt: Union[bytes, str, None] = None,
    ) -> Optional[int]:
        """The longest prefix, in tokens, that ``load`` can restore now; never blocks.

        ``max_tokens`` defaults to all tokens but the last (the serving process must compute at
        least one token to sample from). ``None`` means chunks of a longer hit are in flight: ask
        again next step. A hit longer than the host pool holds is fine: ``load`` streams it.
        """
        self._check_open()
        keys = self._keys(request, salt)
        max_tokens = None if max_tokens is None else check_count("max_tokens", max_tokens, None)
        if max_tokens is None:
            max_tokens = max(0, keys.num_tokens - 1)
        else:
            max_tokens = min(max_tokens, keys.num_tokens)  # no hit is longer than the request
        if self._starting:  # no host slot to load through yet
            self.metrics.lookup()
            self.metrics.miss("starting")
            return 0
        hit = longest_hit(self.layout, max_tokens, self.host.lookup_state(keys))
        self.metrics.lookup()
        if hit is None:
            self.metrics.miss("pending")
        elif hit == 0:
            self.metrics.miss("missing")
        else:
            self.metrics.hit(hit)
        return hit

    # ------------------------------------------------------------------ load

    async def load(
        self,
        request: TokensOrKeys,
        hit_tokens: int,
        block_table: BlockTable,
        *,
        salt: Union[bytes, str, None] = None,
        compute_stream: Any = None,
        ready_event: Any = None,
    ) -> LoadResult:
        """Restore the retained chunks of a hit of ``hit_tokens`` into the device blocks of
        ``block_table`` (same shape as for ``store``; blocks a sliding-window group never restores
        may hold any value). Reads disk -> host slot -> device in windows of at most half of each
        host pool, so a hit larger than the host pool still loads; concurrent loads of one chunk
        share one read. A chunk that turns out unreadable gives ``LoadResult(ok=False, reason=...)``
        (the blocks then hold some of the hit; recompute it).

        Cancelling the caller cancels its wait only: the load runs on into its blocks, and
        ``fence`` on them waits for it. A load interrupted by ``close`` before its copies raises
        ``ClosedError``. The copies are ordered after ``ready_event`` or ``compute_stream`` as
        for ``store``.
        """
        self._check_open()
        ready = self.device.backend.ready_event(compute_stream, ready_event)  # the order, taken now
        keys = self._keys(request, salt)
        hit_tokens, rows = check_load_arguments(self.layout, keys.num_tokens, hit_tokens, block_table)
        if self._starting:
            self.metrics.miss("starting")
            return LoadResult(hit_tokens, False, (), reason="starting")
        _, loads = self._paths()
        jobs, missing = loads.plan(keys, hit_tokens, rows)
        if missing:
            self.metrics.miss("missing")
            return LoadResult(hit_tokens, False, (), reason="missing")
        return await asyncio.shield(loads.start(hit_tokens, jobs, ready))

    # ------------------------------------------------------------------ prefetch

    async def prefetch(
        self,
        request: TokensOrKeys,
        hit_tokens: Optional[int] = None,
        *,
        policy: str = "best_effort",
        timeout_s: Optional[float] = None,
        salt: Union[bytes, str, None] = None,
    ) -> int:
        """Promote disk-only chunks of a hit (default: the longest hit on disk) into host slots.

        ``best_effort``: start the reads and return the number started. ``wait_complete``: wait for
        them and return how many landed. ``timeout``: wait at most ``timeout_s`` and return how many
        landed by then. Paused under memory pressure (returns 0). A read stalled past
        ``tier_timeout_s`` is abandoned (lookup answers from the disk index again). Cancelling the
        wait does not stop the reads; they still land in the host tier.
        """
        self._check_open()
        timeout_s = check_prefetch_policy(policy, timeout_s)
        keys = self._keys(request, salt)
        hit_tokens = None if hit_tokens is None else check_count("hit_tokens", hit_tokens, keys.num_tokens)
        if self._starting:
            return 0
        _, loads = self._paths()
        if self._paused():
            self.metrics.dropped("pressure_prefetch", 1)
            return 0
        if hit_tokens is None:
            hit_tokens = longest_hit(self.layout, max(0, keys.num_tokens - 1), self.host.lookup_state(keys)) or 0
        wanted = loads.promotable(keys, hit_tokens)
        if not wanted:
            return 0
        entries = loads.start_promotion(wanted)
        if entries is None:
            self.metrics.dropped("host_full", len(wanted))
            return 0
        if policy == "best_effort":
            return len(entries)
        readies = [self.host.waiter(e) for e in entries]
        timeout = timeout_s if policy == "timeout" else None
        await asyncio.wait([asyncio.shield(r) for r in readies], timeout=timeout)
        return sum(1 for r in readies if r.done() and r.result() is None)

    # ------------------------------------------------------------------ fences and pins

    async def fence(self, block_ids: Iterable[int], group_index: Optional[int] = None) -> None:
        """Wait until no copy reads or writes the given device blocks (of one group, or of every
        group when ``group_index`` is None), including loads whose caller was cancelled.
        Cancelling the wait stops no copy. Block ids follow a block table's rules (ints within the
        KV cache); a call from another event loop or thread is an ``EngineUsageError``."""
        self._check_started()
        self._check_caller(failed_ok=True)
        groups, blocks = check_fence_arguments(block_ids, group_index, self.host.num_blocks)
        waits = self.host.busy_with(frozenset((gi, block) for gi in groups for block in blocks))
        if waits:
            await asyncio.wait([asyncio.shield(w) for w in waits])

    # ------------------------------------------------------------------ observability

    @property
    def pressure(self) -> Optional[PressureMonitor]:
        """The memory-pressure monitor (``None`` before ``start``)."""
        return self._pressure

    @property
    def disk_tier(self) -> Optional[ChunkTier]:
        """The disk tier in use, if any."""
        return self._disk

    def take_events(self) -> List[ChunkEvent]:
        """Stored/removed chunk events since the last call (key, group, tier), oldest first. The
        log keeps the newest ``config.events_max``; older ones are dropped and counted."""
        return self._events.take()

    def statistics(self) -> Dict[str, Any]:
        """Counters and gauges as plain numbers: metrics, chunks per state (``chunks_by_state`` in
        lookup's words: pending / ready / loading; ``chunks_by_phase`` in the lifecycle table's),
        tiers, pressure."""
        phases = self.host.state_counts()
        states = {name: 0 for name in ("pending", "ready", "loading")}
        for state in HostState:
            states[LEGACY_NAME[state]] += phases[state.value]
        stats: Dict[str, Any] = dict(self.metrics.snapshot())
        stats["chunks_on_disk"] = phases.pop("disk")
        stats["chunks_by_state"] = states
        stats["chunks_by_phase"] = phases
        stats["host"] = [pool.statistics() for pool in self.host.pools]
        stats["disk"] = self._disk.statistics().as_dict() if self._disk is not None else None
        stats["pressure"] = self._pressure.state if self._pressure is not None else "unknown"
        stats["inflight_stores"] = self._stores.inflight if self._stores is not None else 0
        stats["spill_queue"] = len(self._spill.queue) if self._spill is not None else 0
        return stats

    def check(self) -> None:
        """Reconcile entries, pins, host slots and the lifecycle table; raise
        ``EngineInvariantError`` listing every disagreement. Meant for test teardown and the end of
        stress runs, when the engine is idle (``check_disk`` also compares the disk index with the
        tier)."""
        spill, runner = self._spill, self._spill_runner
        idle = not self._tasks and (spill is None or spill.idle or runner is None)
        problems = self.host.problems(idle=idle, queued_ok=runner is None or self._closed)
        if idle and self._stores is not None and self._stores.inflight != 0:
            problems.append(f"{self._stores.inflight} stores in flight while idle")
        if idle and len(self._watch) and runner is not None:
            problems.append(f"{len(self._watch)} store handles still wait for durability while idle")
        if problems:
            raise EngineInvariantError("; ".join(problems))
