"""The asyncio offload engine: what a serving process embeds.

Primitives: ``OffloadEngine`` (store / lookup / load / prefetch / fence / flush / close /
statistics / take_events / check / check_disk). Its errors live in ``kvtier.errors``.

Threads. Every state change happens on the event-loop thread that started the engine (a call from
another loop or thread raises ``EngineUsageError``, from a forked child ``ForkedProcessError``,
before anything is scheduled).
Blocking work runs elsewhere and only reports back: device -> host copies on one copy thread, host
-> device copies on another (two each on CUDA, queueing on kvtier's two copy streams), disk I/O on the disk
tier's own threads. One executor hop per batch of chunks, never per chunk.

Layout. A chunk's life is one transition table (``lifecycle.py``); which keys the disk holds is the
ordered ``DiskIndex`` (``disk_index.py``); write-behind and durable handles are the
``SpillPipeline`` (``spill.py``); stores are the ``StorePath`` (``storing.py``); loads and
promotions are the ``LoadPath`` (``loading.py``);
waiting on engine-owned work and keeping background loops alive is ``tasks.py``. This module holds
the public calls and the host-slot bookkeeping between them.

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
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Container, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from kvtier.errors import EngineInvariantError, EngineUsageError, ForkedProcessError
from kvtier.policy import (
    ChunkState,
    ClosedError,
    DeviceError,
    KeyChain,
    KvtierError,
    ModelLayout,
    TierIOError,
    longest_hit,
)
from kvtier.policy.plan import load_block_plan
from kvtier.policy.retention import check_retention_interval
from kvtier.tiers.base import ChunkMeta, ChunkTier, Removal
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.host import HostSlabPool, pools_for_budget

from .config import EngineConfig
from .disk_index import DiskIndex, keys_of
from .drop_log import DropLog
from .events import EventLog
from .lifecycle import DURABLE_LATER, LEGACY_NAME, LOOKUP_STATE, HostState, move
from .loading import LoadPath
from .metrics import EngineMetrics
from .pressure import LatencyEwma, PressureMonitor, device_memory_source_for, host_memory_source
from .records import ChunkEntry, ChunkEvent, LoadResult, RequestKeys, StoreHandle
from .selfcheck import host_problems
from .spill import SpillPipeline
from .storing import StorePath
from .tasks import Supervised, wait_all
from .validation import (check_count, check_device_kind, check_engine_settings, check_fence_arguments,
                         check_load_arguments, check_load_targets, check_pools_pinned, check_request_keys,
                         check_store_arguments, check_timeout, check_token_ids)

__all__ = ["OffloadEngine", "EngineInvariantError"]

logger = logging.getLogger("kvtier.engine")

TokensOrKeys = Union[Sequence[int], RequestKeys]
BlockTable = Sequence[Sequence[int]]

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")

# Forks of this process so far, counted in the child: an int compare per public call instead of a
# getpid() system call on the lookup path.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


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
    NVML and host-memory sources of the pressure monitor.
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
        self._disk: Optional[ChunkTier] = disk_tier
        self._owns_disk = disk_tier is None
        self._pressure_sources = pressure_sources
        self._pressure: Optional[PressureMonitor] = None
        self._write_latency = LatencyEwma(alpha=0.2, high_latency_s=1.0)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[int] = None
        self._pid = os.getpid()
        self._forks = _forks
        self._pools: List[HostSlabPool] = []
        self._chunk_nbytes: List[int] = []
        self._num_blocks: List[int] = []
        self._entries: Dict[bytes, ChunkEntry] = {}
        self._events = EventLog(self.config.events_max, on_drop=self.metrics.events_dropped)
        self._index = DiskIndex(on_removed=self._index_removed)
        self._spill: Optional[SpillPipeline] = None
        self._loads = LoadPath(self)
        self._spill_runner: Optional[Supervised] = None
        self._refresh_runner: Optional[Supervised] = None
        # In-flight copy batches: completion future -> the (group, device block) pairs it touches.
        self._busy_batches: Dict[asyncio.Future, FrozenSet[Tuple[int, int]]] = {}
        self._tasks: set = set()
        self._stores = StorePath(self)
        self._d2h: Optional[ThreadPoolExecutor] = None
        self._h2d: Optional[ThreadPoolExecutor] = None
        self._metas: List[Tuple[str, Tuple[int, ...]]] = []
        self._started = False
        self._closing = False
        self._closed = False
        self._failure: Optional[BaseException] = None
        self._quarantined_cache_dir: Optional[str] = None

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
        """Allocate the host slabs, open the disk tier, rebuild the disk index, start the spill
        task and the pressure monitor. Cancelling it leaves the engine unusable; call ``close``."""
        if self._started:
            raise RuntimeError("OffloadEngine.start() called twice")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._pid = os.getpid()
        self._forks = _forks
        config = self.config
        # CUDA: two threads per direction, so batch n+1 queues while batch n's thread waits on its event.
        workers = 2 if self.device.backend.is_cuda else 1
        self._d2h = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-d2h")
        self._h2d = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-h2d")
        self._pools = await asyncio.to_thread(self._make_pools)  # off the loop: seconds for a large slab
        # Per group, bytes of one chunk: asked per chunk on every store, spill and load path.
        self._chunk_nbytes = [self.device.chunk_nbytes(g) for g in range(len(self.layout.groups))]
        self._num_blocks = [self.device.num_blocks(g) for g in range(len(self.layout.groups))]
        self._metas = [
            (str(self.device.chunk_dtype(g)).replace("torch.", ""), tuple(self.device.chunk_shape(g)))
            for g in range(len(self.layout.groups))
        ]
        self.metrics.set_state_counts(self._state_counts)
        if self._disk is None and config.cache_dir is not None:
            self._disk = await self._open_cache_dir()
        if self._owns_disk and config.remote_url is not None:
            from .remote_chain import attach_remote_tier  # host -> LMDB -> remote (tiers/chain.py)

            self._disk = await attach_remote_tier(self._disk, config, self.fingerprint)
            self.metrics.set_tier_statistics(self._disk_statistics)
        self._spill = SpillPipeline(self)
        if self._disk is not None:
            self._subscribe_disk_evictions()
            try:
                keys, sequence = await self._disk_listing()
            except ClosedError:
                raise
            except KvtierError as exc:
                # Keep serving: without the index the disk's chunks are misses until the next start,
                # and new stores still spill (or fail and are counted).
                logger.warning("cannot list the disk tier's chunks, starting with an empty disk index: %s", exc)
                keys, sequence = [], None
            self._index.replace_all(keys, sequence)
        if self._disk is not None and config.spill_enabled:
            self._spill_runner = self._supervise("spill", self._spill.run)
        if self._disk is not None and config.disk_index_refresh_interval_s is not None:
            self._refresh_runner = self._supervise("disk-index", self._refresh_loop)
        sources = self._pressure_sources
        if sources is None:
            sources = {"host_memory": host_memory_source(own_bytes=self._host_slab_bytes),
                       "device_memory": device_memory_source_for(self.device)}
        sources = dict(sources)
        sources.setdefault("disk_write_latency", self._write_latency.fraction)
        self._pressure = PressureMonitor(
            sources,
            high_fraction=config.pressure_high_watermark_fraction,
            low_fraction=config.pressure_low_watermark_fraction,
            poll_interval_s=config.pressure_poll_interval_s,
        )
        self.metrics.watch_pressure(lambda: self._pressure is not None and self._pressure.paused)
        await self._pressure.start()

    def _host_slab_bytes(self) -> int:
        # Read on the pressure monitor's thread: a plain sum over a list that no longer changes.
        return sum(int(pool.statistics()["capacity_bytes"]) for pool in list(self._pools) if not pool.closed)

    def _supervise(self, name: str, factory) -> Supervised:
        def crashed(exc: BaseException) -> None:
            self.metrics.worker_error(f"{name.replace('-', '_')}_loop")

        runner = Supervised(
            f"kvtier-{name}",
            factory,
            running=lambda: not self._closing,
            on_crash=crashed,
            on_give_up=self._fail,
        )
        runner.start()
        return runner

    def _fail(self, exc: BaseException) -> None:
        """A background loop crashed for good: the engine refuses new work, loudly, and every
        handle still waiting for the disk resolves ``False``."""
        self._failure = exc
        logger.critical("kvtier engine failed: a background loop keeps crashing (%r); closing is all that is left", exc)
        if self._spill is not None:
            self._spill.watch.fail_all()

    def _disk_statistics(self) -> Dict[str, float]:
        from kvtier.tiers.chain import tier_statistics_dict

        return tier_statistics_dict(self._disk) if self._disk is not None else {}

    async def _open_cache_dir(self) -> ChunkTier:
        """Open the LMDB tier at ``config.cache_dir``; a damaged one is moved aside and recreated
        when ``config.quarantine_corrupt_cache_dir`` (the default), else its error propagates."""
        from kvtier.tiers.lmdb import LmdbTier, open_replacing_damaged

        config = self.config
        kwargs: Dict[str, Any] = dict(
            capacity_bytes=config.disk_capacity_bytes,
            map_size_bytes=config.lmdb_map_size_bytes,
            codec=config.codec_config(),
            reader_check_interval_s=config.reader_check_interval_s,
            verify_structure=config.lmdb_verify_on_open,
            segment_threshold_bytes=config.lmdb_segment_threshold_bytes,
            segment_compaction_live_fraction=config.lmdb_segment_compaction_live_fraction,
            eviction_policy=config.eviction_policy,
        )
        tier, aside = await open_replacing_damaged(config.cache_dir, lambda: LmdbTier.open(config.cache_dir, **kwargs),
                                                   quarantine=config.quarantine_corrupt_cache_dir)
        if aside is not None:
            self._quarantined_cache_dir = str(aside)
        return tier

    @property
    def quarantined_cache_dir(self) -> Optional[str]:
        """Where ``start`` moved a damaged ``cache_dir`` (``None`` when it did not)."""
        return self._quarantined_cache_dir

    @property
    def closed(self) -> bool:
        """True once ``close`` finished."""
        return self._closed

    @property
    def closing(self) -> bool:
        """True from the moment ``close`` was called."""
        return self._closing

    def _make_pools(self) -> List[HostSlabPool]:
        """The host pools, of the view's device kind; on CUDA they must be page-locked. Runs on a
        worker thread: pre-faulting (and registering) a large slab takes seconds."""
        check_device_kind(self.config.device_kind, self.device)
        chunk_bytes = [self.device.chunk_nbytes(g) for g in range(len(self.layout.groups))]
        # The view's own device ("cuda:1"): the slab is registered with that device current.
        pools = pools_for_budget(self.config.host_capacity_bytes, chunk_bytes, device_kind=str(self.device.device),
                                 eviction=self.config.host_policy())
        check_pools_pinned(self.device, pools)
        return pools

    # ------------------------------------------------------------------ the disk index

    @property
    def disk_index(self) -> DiskIndex:
        """Which keys the engine believes the disk tier holds (read-only use; see ``DiskIndex``)."""
        return self._index

    async def _disk_listing(self) -> Tuple[List[bytes], Optional[int]]:
        """The tier's keys with the tier sequence they reflect (``snapshot_keys``, tier contract)."""
        taken = await self._disk.snapshot_keys()
        return list(taken.keys), taken.sequence

    def _subscribe_disk_evictions(self) -> None:
        # A record the disk tier drops (capacity eviction, quarantine, delete) must leave the index
        # at once, or lookup would admit a hit whose chunk is gone.
        loop, loop_thread = self._loop, self._loop_thread

        def on_removed(removals: Sequence[Removal]) -> None:
            # The tier contract delivers on this loop; a tier that calls from its own thread is
            # handed over rather than trusted.
            removals = list(removals)
            if threading.get_ident() == loop_thread:
                self._disk_removed(removals)
            else:
                loop.call_soon_threadsafe(self._disk_removed, removals)

        self._disk.subscribe_removals(on_removed)

    def _disk_removed(self, removals: Sequence[Removal]) -> None:
        for key, sequence in keys_of(removals):
            self._index.remove(key, sequence)
        # Deletes are asked for; the rest (capacity, quarantine, gone from a listing) are evictions.
        self.metrics.evicted("disk", sum(1 for r in removals if r.reason != "deleted"))

    def _index_removed(self, key: bytes) -> None:
        entry = self._entries.get(key)
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
        if self._disk is None:
            return 0, 0
        token = self._index.begin()
        try:
            keys, sequence = await self._disk_listing()
            added, removed = self._index.refresh(keys, token, sequence)
        except (KvtierError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a foreign tier error reaches the caller typed, its cause kept
            self.metrics.worker_error("refresh")
            raise TierIOError(f"listing the disk tier failed: {exc!r}") from exc
        finally:
            self._index.end(token)
        if added and self._spill is not None and self._spill.queue:
            self._spill.wake()
        return added, removed

    async def _refresh_loop(self) -> None:
        interval = self.config.disk_index_refresh_interval_s
        while not self._closing:
            await asyncio.sleep(interval)
            try:
                await self.refresh_disk_index()
            except ClosedError:
                return
            except Exception as exc:  # keep serving on the index we have; try again next time
                logger.warning("refreshing the disk index failed: %r", exc)
                self.metrics.worker_error("refresh")

    async def check_disk(self) -> None:
        """Compare the disk index with the tier: every indexed key must be on the tier (else
        ``lookup`` admits a hit that ``load`` fails), and the tier's own ``check()`` must pass.
        Raises ``EngineInvariantError`` listing each problem. Meant for an idle engine (test
        teardown, end of stress runs). Cancelling the call drops the answer only."""
        self._check_started()
        if self._disk is None:
            return
        problems: List[str] = []
        before = self._index.keys()
        listed = set(await self._disk.list_keys())
        # Keys indexed before and after the listing (a removal meanwhile takes a key out).
        ghosts = [k for k in before if k in self._index and k not in listed]
        if ghosts:
            problems.append(f"{len(ghosts)} indexed keys are not on the disk tier (first {ghosts[0].hex()[:12]})")
        if self._disk is not None:
            problems.extend(f"disk tier: {p}" for p in await self._disk.check())
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
        if self._refresh_runner is not None:
            self._refresh_runner.cancel()
            await self._refresh_runner.wait()
        if self._spill_runner is not None:
            self._spill.wake()
            await self._spill_runner.wait()
        while any(not t.done() for t in self._tasks):
            await wait_all([t for t in self._tasks if not t.done()])
        if self._spill is not None:
            self._spill.watch.fail_all()
        if self._pressure is not None:
            await self._pressure.stop()
        if self._disk is not None and self._owns_disk:
            await self._disk.close()
        for executor in (self._d2h, self._h2d):
            if executor is not None:
                executor.shutdown(wait=True)
        for pool in self._pools:
            pool.close()
        self.metrics.watch_pressure(None)
        self._closed = True

    def _check_open(self) -> None:
        if self._closing or self._closed:
            raise ClosedError("the offload engine is closed")
        if not self._started:
            raise ClosedError("the offload engine is not started: use `async with OffloadEngine(...)`")
        self._check_caller()

    def _check_caller(self, failed_ok: bool = False) -> None:
        if _forks != self._forks:
            raise ForkedProcessError(
                f"this OffloadEngine was started by pid {self._pid}; a forked child (pid {os.getpid()}) "
                "must start its own engine"
            )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise EngineUsageError(
                "this OffloadEngine belongs to the event loop that started it; it was called from "
                + ("another event loop" if running is not None else "a thread without a running event loop")
            )
        if self._failure is not None and not failed_ok:
            raise EngineUsageError(f"the offload engine failed: {self._failure!r}; close it and start a new one")

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
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

    def _state(self, keys: RequestKeys) -> Callable[[int, int], ChunkState]:
        entries = self._entries
        on_disk = self._index
        key_lists = keys.keys
        lookup_state = LOOKUP_STATE

        def state(group_index: int, chunk_index: int) -> ChunkState:
            group_keys = key_lists[group_index]
            if chunk_index >= len(group_keys):
                return ChunkState.MISSING
            key = group_keys[chunk_index]
            entry = entries.get(key)
            if entry is not None:
                return lookup_state[entry.state]
            return ChunkState.READY if key in on_disk else ChunkState.MISSING

        return state

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
        num_tokens, block_table = check_store_arguments(self.layout, keys.num_tokens, num_tokens, block_table)
        return self._stores.schedule(keys, num_tokens, block_table,
                                     self.device.backend.ready_event(compute_stream, ready_event))

    def _allocate_slots(self, groups: Iterable[int]) -> Optional[Dict[int, List[int]]]:
        """One host slot per item of ``groups`` (a group index per chunk), all or nothing across
        groups; evicted chunks leave the index. ``None`` when the pools cannot make room: then
        nothing was evicted in any group (every group is checked before the first eviction)."""
        needed: Dict[int, int] = {}
        for gi in groups:
            needed[gi] = needed.get(gi, 0) + 1
        for gi, count in needed.items():
            pool = self._pools[gi]
            if pool.num_free + pool.num_evictable < count:
                return None
        granted: Dict[int, List[int]] = {}
        for gi, count in needed.items():
            allocation = self._pools[gi].allocate(count)
            if allocation is None:  # cannot happen after the check above; stay all-or-nothing anyway
                for g, slots in granted.items():
                    for slot in slots:
                        self._pools[g].release(slot)
                return None
            self._evicted(gi, allocation.evicted)
            granted[gi] = list(allocation.slots)
        return granted

    def _new_entries(self, wanted, state: HostState, slots: Dict[int, List[int]],
                     speculative: Container[Tuple[int, int]] = ()) -> List[ChunkEntry]:
        """Index an entry per (group, chunk, key) in ``wanted`` in the given slots, pinned once for
        the copy that is about to fill them; a (group, chunk) in ``speculative`` is told to the
        host pool's policy as such (stored only for partial-prefix hits)."""
        iters = {g: iter(s) for g, s in slots.items()}
        entries = []
        for gi, chunk, key in wanted:
            slot = next(iters[gi])
            entry = ChunkEntry(key, gi, chunk, state, slot, ready=self._loop.create_future())
            self._pools[gi].set_owner(slot, entry, key=key, speculative=(gi, chunk) in speculative)
            self._pin(entry)
            self._entries[key] = entry
            entries.append(entry)
        return entries

    def _evicted(self, group_index: int, evicted: Sequence[Tuple[int, Any]]) -> None:
        for _slot, entry in evicted:
            if entry is None:
                continue
            entry.dead = True
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            self._events.append("removed", entry.key, group_index, "host")
            if entry.key not in self._index:
                self.metrics.dropped("evicted", 1)
        if evicted:
            self.metrics.evicted("host", len(evicted))

    def _settle_ready(self, entry: ChunkEntry) -> None:
        """``entry``'s bytes are valid and nothing is in flight: READY, and evictable."""
        move(entry, HostState.READY)
        self._pools[entry.group_index].mark_evictable(entry.slot, True)

    def _chunk_meta(self, entry: ChunkEntry) -> ChunkMeta:
        dtype, shape = self._metas[entry.group_index]
        return ChunkMeta(self.fingerprint, entry.group_index, entry.chunk_index, dtype, shape)

    def _resolve_ready(self, entry: ChunkEntry, reason: Optional[str]) -> None:
        if entry.ready is not None and not entry.ready.done():
            entry.ready.set_result(reason)

    async def flush(self) -> None:
        """Wait until every operation started so far has finished: device copies of stores, their
        spills (with a disk tier), loads and prefetch reads. Cancelling the wait stops nothing."""
        self._check_started()
        self._check_caller(failed_ok=True)
        while True:
            # Done tasks leave _tasks in a done-callback, a loop iteration later: wait only for the
            # running ones, or this loop would spin without ever yielding.
            running = [t for t in self._tasks if not t.done()]
            if running:
                await wait_all(running)
                continue
            if self._spill_runner is not None and not self._spill_runner.done.is_set() and not self._spill.idle:
                await self._spill.drain()
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
        hit = longest_hit(self.layout, max_tokens, self._state(keys))
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
        hit_tokens, block_table = check_load_arguments(self.layout, keys.num_tokens, hit_tokens, block_table)
        jobs = []  # (group, chunk, key, device block per block of the chunk or None)
        missing = False
        for gi in range(len(self.layout.groups)):
            table = block_table[gi]
            seen: Dict[int, int] = {}
            for chunk, blocks in load_block_plan(self.layout, gi, hit_tokens):
                key = keys.key(gi, chunk)
                if key is None:
                    missing = True
                    continue
                targets: List[Optional[int]] = []
                for block in blocks:
                    if block is None:
                        targets.append(None)
                        continue
                    if block >= len(table) or table[block] is None or table[block] < 0:
                        raise ValueError(f"block_table[{gi}] has no device block for logical block {block}")
                    targets.append(int(table[block]))
                self._check_device_blocks(gi, [t for t in targets if t is not None])
                check_load_targets(gi, targets, seen, blocks)
                jobs.append((gi, chunk, key, targets))
        if missing:
            self.metrics.miss("missing")
            return LoadResult(hit_tokens, False, (), reason="missing")
        # The whole load fences its blocks from now until its last copy ended.
        finished = self._loop.create_future()
        self._mark_busy([(g, t) for g, _, _, targets in jobs for t in targets if t is not None], finished)
        task = self._spawn(self._loads.run(hit_tokens, jobs, finished, ready))
        return await asyncio.shield(task)

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
        if not isinstance(policy, str) or policy not in PREFETCH_POLICIES:
            raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {policy!r}")
        timeout_s = check_timeout("timeout_s", timeout_s)
        if policy == "timeout" and timeout_s is None:
            raise ValueError(f"policy 'timeout' needs a positive timeout_s, got {timeout_s!r}")
        keys = self._keys(request, salt)
        hit_tokens = None if hit_tokens is None else check_count("hit_tokens", hit_tokens, keys.num_tokens)
        if self._pressure is not None and self._pressure.paused:
            self.metrics.dropped("pressure_prefetch", 1)
            return 0
        if hit_tokens is None:
            hit_tokens = longest_hit(self.layout, max(0, keys.num_tokens - 1), self._state(keys)) or 0
        wanted = []
        for gi in range(len(self.layout.groups)):
            for chunk, _ in load_block_plan(self.layout, gi, hit_tokens):
                key = keys.key(gi, chunk)
                if key is not None and key not in self._entries and key in self._index:
                    wanted.append((gi, chunk, key))
        if not wanted:
            return 0
        entries = self._loads.start_promotion(wanted)
        if entries is None:
            self.metrics.dropped("host_full", len(wanted))
            return 0
        if policy == "best_effort":
            return len(entries)
        waits = [asyncio.shield(e.ready) for e in entries]
        timeout = timeout_s if policy == "timeout" else None
        await asyncio.wait(waits, timeout=timeout)
        return sum(1 for e in entries if e.ready.done() and e.ready.result() is None)

    # ------------------------------------------------------------------ fences and pins

    async def fence(self, block_ids: Iterable[int], group_index: Optional[int] = None) -> None:
        """Wait until no copy reads or writes the given device blocks (of one group, or of every
        group when ``group_index`` is None), including loads whose caller was cancelled.
        Cancelling the wait stops no copy. Block ids follow a block table's rules (ints within the
        KV cache); a call from another event loop or thread is an ``EngineUsageError``."""
        self._check_started()
        self._check_caller(failed_ok=True)
        groups, blocks = check_fence_arguments(block_ids, group_index, self._num_blocks)
        wanted = {(gi, block) for gi in groups for block in blocks}
        waits = [done for done, busy in self._busy_batches.items() if not busy.isdisjoint(wanted)]
        if waits:
            await asyncio.wait([asyncio.shield(w) for w in waits])

    def _mark_busy(self, blocks: Sequence[Tuple[int, int]], done: asyncio.Future) -> None:
        # One record per copy batch, not per block: marking and clearing cost a few Python steps
        # per batch instead of two dict operations per block (~6 us per chunk of 4 blocks); a fence
        # scans the few batches in flight.
        self._busy_batches[done] = frozenset(blocks)
        done.add_done_callback(self._clear_busy)

    def _clear_busy(self, done: asyncio.Future) -> None:
        self._busy_batches.pop(done, None)

    def _pin(self, entry: ChunkEntry) -> None:
        entry.pins += 1
        self._pools[entry.group_index].pin(entry.slot)

    def _unpin(self, entry: ChunkEntry) -> None:
        entry.pins -= 1
        pool = self._pools[entry.group_index]
        pool.unpin(entry.slot)
        if entry.dead and entry.pins == 0:
            pool.release(entry.slot)

    def _drop_entry(self, entry: ChunkEntry, reason: Optional[str]) -> None:
        """Remove an entry from the index; its slot is released when its last pin goes. Handles
        waiting for its spill learn it will not come."""
        if entry.dead:
            return
        entry.dead = True
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if entry.state in DURABLE_LATER and self._spill is not None:
            self._spill.watch.resolve(entry.key, False)
        if entry.pins == 0:
            self._pools[entry.group_index].release(entry.slot)
        if reason is not None:
            self.metrics.dropped(reason, 1)

    def _check_device_blocks(self, group_index: int, blocks: Sequence[int]) -> None:
        # Checked before anything is scheduled, so a bad table is the caller's typed error, not a
        # copy that fails later on a worker thread.
        limit = self._num_blocks[group_index]
        for block in blocks:
            if not 0 <= block < limit:
                raise DeviceError(
                    f"group {group_index}: device block {block} is out of range (the KV cache has {limit} blocks)"
                )

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

    def _state_counts(self) -> Dict[str, int]:
        """Chunks per lifecycle state, and ``disk``. May run on an exporter thread: it reads a copy
        of the values, never iterates the live dict."""
        counts = {state.value: 0 for state in HostState}
        for entry in list(self._entries.values()):
            counts[entry.state.value] += 1
        counts["disk"] = len(self._index)
        return counts

    def statistics(self) -> Dict[str, Any]:
        """Counters and gauges as plain numbers: metrics, chunks per state (``chunks_by_state`` in
        lookup's words: pending / ready / loading; ``chunks_by_phase`` in the lifecycle table's),
        tiers, pressure."""
        phases = self._state_counts()
        states = {name: 0 for name in ("pending", "ready", "loading")}
        for state in HostState:
            states[LEGACY_NAME[state]] += phases[state.value]
        stats: Dict[str, Any] = dict(self.metrics.snapshot())
        stats["chunks_on_disk"] = phases.pop("disk")
        stats["chunks_by_state"] = states
        stats["chunks_by_phase"] = phases
        stats["host"] = [pool.statistics() for pool in self._pools]
        stats["disk"] = self._disk.statistics().as_dict() if self._disk is not None else None
        stats["pressure"] = self._pressure.state if self._pressure is not None else "unknown"
        stats["inflight_stores"] = self._stores.inflight
        stats["spill_queue"] = len(self._spill.queue) if self._spill is not None else 0
        return stats

    def check(self) -> None:
        """Reconcile entries, pins, host slots and the lifecycle table; raise
        ``EngineInvariantError`` listing every disagreement. Meant for test teardown and the end of
        stress runs, when the engine is idle (``check_disk`` also compares the disk index with the
        tier)."""
        problems = host_problems(self)
        if problems:
            raise EngineInvariantError("; ".join(problems))
