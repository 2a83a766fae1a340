"""The asyncio offload engine: what a serving process embeds.

Primitives: ``OffloadEngine`` (store / lookup / load / prefetch / fence / flush / close /
statistics / take_events / check).

Threads. Every state change happens on the event-loop thread that started the engine. Blocking
work runs elsewhere and only reports back: device -> host copies on one copy thread, host -> device
copies on another (the CPU stand-ins for the two CUDA copy streams), disk I/O on the disk tier's own
threads (one LMDB writer, a small read pool). One executor hop per batch of chunks, never per chunk.

States. A chunk with a host slot has a ``ChunkEntry``: PENDING (device -> host in flight), READY,
LOADING (disk -> host in flight). A chunk only on disk is just a key in ``_on_disk``. ``lookup``
maps these to ``ChunkState`` and asks ``longest_hit``. Pins (reference counts) keep a slot from
eviction or release while any copy reads or writes it; an abandoned copy (timeout, close) bumps the
entry's generation so its late completion is discarded and only then frees the slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from kvtier.errors import EngineInvariantError
from kvtier.policy import (
    ChunkState,
    ClosedError,
    DeviceError,
    KvtierError,
    KeyChain,
    ModelLayout,
    longest_hit,
)
from kvtier.policy.plan import load_block_plan, store_chunk_indices
from kvtier.tiers.base import ChunkMeta, ChunkTier, Removal
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.host import HostSlabPool

from .config import EngineConfig
from .drop_log import DropLog, drop_detail
from .metrics import EngineMetrics
from .pressure import LatencyEwma, PressureMonitor, host_memory_source, nvml_device_memory_source
from .records import ChunkEntry, ChunkEvent, HostState, LoadResult, RequestKeys, StoreHandle
from .validation import check_count, check_engine_settings, check_load_arguments, check_store_arguments, check_token_ids

__all__ = ["OffloadEngine", "EngineInvariantError"]

logger = logging.getLogger("kvtier.engine")

TokensOrKeys = Union[Sequence[int], RequestKeys]
BlockTable = Sequence[Sequence[int]]

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# Spill batches in flight at once: two let the disk tier encode one while it commits the other.
_SPILL_BATCHES_IN_FLIGHT = 2


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
        self.metrics = EngineMetrics()
        self._drop_log = DropLog()
        self._disk: Optional[ChunkTier] = disk_tier
        self._owns_disk = disk_tier is None
        self._pressure_sources = pressure_sources
        self._pressure: Optional[PressureMonitor] = None
        self._write_latency = LatencyEwma(alpha=0.2, high_latency_s=1.0)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._pools: List[HostSlabPool] = []
        self._chunk_nbytes: List[int] = []
        self._num_blocks: List[int] = []
        self._entries: Dict[bytes, ChunkEntry] = {}
        self._on_disk: Set[bytes] = set()
        self._spill_queue: Deque[ChunkEntry] = deque()
        self._spill_wakeup: Optional[asyncio.Event] = None
        self._spill_task: Optional[asyncio.Task] = None
        self._refresh_task: Optional[asyncio.Task] = None
        self._spill_idle: Optional[asyncio.Event] = None
        self._spill_last_done = 0.0  # perf_counter() when the last spill batch finished
        self._durable_watch: Dict[bytes, List[StoreHandle]] = {}
        self._handle_waiting: Dict[StoreHandle, Set[bytes]] = {}
        # In-flight copy batches: completion future -> the (group, device block) pairs it touches.
        self._busy_batches: Dict[asyncio.Future, FrozenSet[Tuple[int, int]]] = {}
        self._tasks: Set[asyncio.Task] = set()
        self._events: List[ChunkEvent] = []
        self._inflight_stores = 0
        self._d2h: Optional[ThreadPoolExecutor] = None
        self._h2d: Optional[ThreadPoolExecutor] = None
        self._metas: List[Tuple[str, Tuple[int, ...]]] = []
        self._started = False
        self._closing = False
        self._closed = False
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
        config = self.config
        self._d2h = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-d2h")
        self._h2d = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-h2d")
        self._pools = self._make_pools()
        # Per group, bytes of one chunk: asked per chunk on every store, spill and load path.
        self._chunk_nbytes = [self.device.chunk_nbytes(g) for g in range(len(self.layout.groups))]
        self._num_blocks = [self.device.num_blocks(g) for g in range(len(self.layout.groups))]
        self._metas = [
            (str(self.device.chunk_dtype(g)).replace("torch.", ""), tuple(self.device.chunk_shape(g)))
            for g in range(len(self.layout.groups))
        ]
        if self._disk is None and config.cache_dir is not None:
            self._disk = await self._open_cache_dir()
        if self._owns_disk and config.remote_url is not None:
            from .remote_chain import attach_remote_tier  # host -> LMDB -> remote (tiers/chain.py)

            self._disk = await attach_remote_tier(self._disk, config, self.fingerprint)
            self.metrics.set_tier_statistics(self._disk_statistics)
        if self._disk is not None:
            self._subscribe_disk_evictions()
            try:
                self._on_disk = set(await self._disk.list_keys())
            except ClosedError:
                raise
            except KvtierError as exc:
                # Keep serving: without the index the disk's chunks are misses until the next start,
                # and new stores still spill (or fail and are counted).
                logger.warning("cannot list the disk tier's chunks, starting with an empty disk index: %s", exc)
                self._on_disk = set()
        self._spill_wakeup = asyncio.Event()
        self._spill_idle = asyncio.Event()
        self._spill_idle.set()
        if self._disk is not None and config.spill_enabled:
            self._spill_task = self._loop.create_task(self._spill_loop(), name="kvtier-spill")
        if self._disk is not None and config.disk_index_refresh_interval_s is not None:
            self._refresh_task = self._loop.create_task(self._refresh_loop(), name="kvtier-disk-index")
        sources = self._pressure_sources
        if sources is None:
            sources = {"host_memory": host_memory_source()}
            if config.device_kind == "cuda":
                sources["device_memory"] = nvml_device_memory_source(self.device.device_index())
            else:
                # No GPU to watch: NVML is still asked once so the log says "unknown" for it.
                sources["device_memory"] = nvml_device_memory_source(0)
        sources = dict(sources)
        sources.setdefault("disk_write_latency", self._write_latency.fraction)
        self._pressure = PressureMonitor(
            sources,
            high_fraction=config.pressure_high_watermark_fraction,
            low_fraction=config.pressure_low_watermark_fraction,
            poll_interval_s=config.pressure_poll_interval_s,
        )
        await self._pressure.start()

    def _disk_statistics(self) -> Dict[str, float]:
        from kvtier.tiers.chain import tier_statistics_dict

        return tier_statistics_dict(self._disk) if self._disk is not None else {}

    async def _open_cache_dir(self) -> ChunkTier:
        """Open the LMDB tier at ``config.cache_dir``; a damaged one is moved aside and recreated
        when ``config.quarantine_corrupt_cache_dir`` (the default), else its error propagates."""
        from kvtier.tiers.lmdb import CorruptCacheError, LmdbTier, quarantine_cache_dir
        from kvtier.tiers.record import CodecConfig

        config = self.config
        kwargs: Dict[str, Any] = dict(
            capacity_bytes=config.disk_capacity_bytes,
            map_size_bytes=config.lmdb_map_size_bytes,
            codec=CodecConfig(
                level=config.compression_level,
                min_savings_fraction=config.compression_min_savings_fraction,
                compress=config.compression_enabled,
            ),
            reader_check_interval_s=config.reader_check_interval_s,
            verify_structure=config.lmdb_verify_on_open,
        )
        try:
            return await LmdbTier.open(config.cache_dir, **kwargs)
        except CorruptCacheError as exc:
            if not config.quarantine_corrupt_cache_dir:
                raise
            aside = await self._loop.run_in_executor(None, quarantine_cache_dir, config.cache_dir)
            self._quarantined_cache_dir = str(aside)
            logger.error("cache directory %s is damaged (%s); moved aside to %s, starting with an empty one",
                         config.cache_dir, exc, aside)
        return await LmdbTier.open(config.cache_dir, **kwargs)

    @property
    def quarantined_cache_dir(self) -> Optional[str]:
        """Where ``start`` moved a damaged ``cache_dir`` (``None`` when it did not)."""
        return self._quarantined_cache_dir

    def _make_pools(self) -> List[HostSlabPool]:
        # Split the host budget in proportion to each group's chunk bytes, with a floor of a few
        # slots so that a tiny group can still hold the chunks of one request.
        groups = range(len(self.layout.groups))
        chunk_bytes = [self.device.chunk_nbytes(g) for g in groups]
        total = sum(chunk_bytes)
        pools = []
        for g in groups:
            share = self.config.host_capacity_bytes * chunk_bytes[g] // total
            slots = max(4, share // chunk_bytes[g])
            pools.append(
                HostSlabPool(
                    chunk_bytes[g],
                    slots,
                    device_kind=self.config.device_kind,
                    eviction=self.config.host_eviction_policy,
                )
            )
        return pools

    def _subscribe_disk_evictions(self) -> None:
        # A record the disk tier drops (capacity eviction, quarantine) must leave the index at once,
        # or lookup would admit a hit whose chunk is gone. The tier calls back on this loop.
        self._disk.subscribe_removals(self._disk_removed)

    def _disk_removed(self, removals: Sequence[Removal]) -> None:
        dropped = 0
        for removal in removals:
            if removal.reason != "deleted":  # deletes are asked for, not tier evictions
                dropped += 1
            key = removal.key
            if key in self._on_disk:
                self._on_disk.discard(key)
                entry = self._entries.get(key)
                group = entry.group_index if entry is not None else -1
                self._events.append(ChunkEvent("removed", key, group, "disk"))
        self.metrics.evicted("disk", dropped)

    async def close(self) -> None:
        """Stop accepting work, let in-flight copies finish (they cannot be interrupted), fail their
        waiters with ``ClosedError``, close the disk tier. Safe to call twice. Cancelling ``close``
        leaves the engine closing; call it again to finish."""
        if self._closed:
            return
        self._closing = True
        if self._spill_wakeup is not None:
            self._spill_wakeup.set()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        if self._spill_task is not None:
            await asyncio.gather(self._spill_task, return_exceptions=True)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for handle in list(self._handle_waiting):
            self._finish_durable(handle, False)
        if self._pressure is not None:
            await self._pressure.stop()
        if self._disk is not None and self._owns_disk:
            await self._disk.close()
        for executor in (self._d2h, self._h2d):
            if executor is not None:
                executor.shutdown(wait=True)
        self._closed = True

    def _check_open(self) -> None:
        if self._closing or self._closed:
            raise ClosedError("the offload engine is closed")
        if not self._started:
            raise ClosedError("the offload engine is not started: use `async with OffloadEngine(...)`")

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def refresh_disk_index(self) -> Tuple[int, int]:
        """Re-read which chunks the disk tier holds, for a cache directory another process writes
        (a warmup beside a serving process). Returns (keys added, keys removed).

        Keys this engine spills while the listing runs are kept; keys that were indexed before the
        listing began and are absent from it were removed by another process and leave the index.
        Cancelling the call leaves the index as it was."""
        self._check_open()
        if self._disk is None:
            return 0, 0
        before = set(self._on_disk)
        listed = set(await self._disk.list_keys())
        removed = before - listed
        added = listed - self._on_disk
        self._on_disk -= removed
        self._on_disk |= listed
        for key in removed:
            self._events.append(ChunkEvent("removed", key, -1, "disk"))
        return len(added), len(removed)

    async def _refresh_loop(self) -> None:
        interval = self.config.disk_index_refresh_interval_s
        while not self._closing:
            await asyncio.sleep(interval)
            try:
                await self.refresh_disk_index()
            except ClosedError:
                return
            except KvtierError as exc:  # keep serving on the index we have; try again next time
                logger.warning("refreshing the disk index failed: %s", exc)

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
            return request
        return self.request_keys(request, salt=salt)

    def _state(self, keys: RequestKeys) -> Callable[[int, int], ChunkState]:
        entries = self._entries
        on_disk = self._on_disk
        key_lists = keys.keys

        def state(group_index: int, chunk_index: int) -> ChunkState:
            group_keys = key_lists[group_index]
            if chunk_index >= len(group_keys):
                return ChunkState.MISSING
            key = group_keys[chunk_index]
            entry = entries.get(key)
            if entry is not None:
                if entry.state is HostState.READY:
                    return ChunkState.READY
                if entry.state is HostState.PENDING:
                    return ChunkState.PENDING
                return ChunkState.LOADING
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
    ) -> StoreHandle:
        """Schedule the store of a request's chunks and return at once.

        ``block_table[g][i]`` is the device block of logical block ``i`` of group ``g``;
        ``num_tokens`` (default: all tokens of the request) is how many tokens are final.
        Full-attention groups store every complete chunk; sliding-window groups only the chunks
        ``reachable_store_block_mask`` selects (MTP-widened). Chunks already stored or in flight are
        skipped. Under memory pressure, a full store queue or a full host pool, the new chunks are
        dropped and counted, never waited for. The caller must not overwrite the device blocks before
        ``handle.wait_released()`` (or ``fence``).
        """
        self._check_open()
        keys = self._keys(request, salt)
        num_tokens, block_table = check_store_arguments(self.layout, keys.num_tokens, num_tokens, block_table)
        if num_tokens is None:
            num_tokens = keys.num_tokens
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= keys.num_tokens:
            raise ValueError(f"num_tokens must be in [0, {keys.num_tokens}], got {num_tokens!r}")
        self._check_block_table(block_table)

        jobs: List[Tuple[int, int, bytes, List[int]]] = []  # (group, chunk, key, device blocks)
        skipped: List[Tuple[int, int]] = []
        for gi, group in enumerate(self.layout.groups):
            per_chunk = group.blocks_per_chunk
            table = block_table[gi]
            for chunk in store_chunk_indices(self.layout, gi, num_tokens):
                key = keys.keys[gi][chunk]
                if key in self._entries or key in self._on_disk:
                    skipped.append((gi, chunk))
                    continue
                first = chunk * per_chunk
                if len(table) < first + per_chunk:
                    raise ValueError(
                        f"block_table[{gi}] has {len(table)} blocks; chunk {chunk} needs blocks "
                        f"{first}..{first + per_chunk - 1}"
                    )
                blocks = [int(b) for b in table[first : first + per_chunk]]
                self._check_device_blocks(gi, blocks)
                jobs.append((gi, chunk, key, blocks))

        drop_reason = self._store_drop_reason(len(jobs))
        allocations: Dict[int, List[int]] = {}
        if drop_reason is None and jobs:
            allocations = self._allocate_slots(g for g, _, _, _ in jobs)
            if allocations is None:
                drop_reason = "host_full"
        if drop_reason is not None:
            dropped = [(g, c) for g, c, _, _ in jobs]
            if dropped:
                self.metrics.dropped(drop_reason, len(dropped))
                self._drop_log.note(drop_reason, len(dropped), drop_detail(
                    drop_reason, (g for g, _ in dropped), inflight=self._inflight_stores,
                    queue_max_chunks=self.config.store_queue_max_chunks, pool_slots=[p.num_slots for p in self._pools]))
            handle = StoreHandle(self._loop, (), skipped, dropped, drop_reason)
            handle._released.set_result(None)
            handle._durable.set_result(not dropped and self._disk is not None)
            return handle

        handle = StoreHandle(self._loop, [(g, c) for g, c, _, _ in jobs], skipped, (), None)
        if not jobs:
            handle._released.set_result(None)
            handle._durable.set_result(self._disk is not None)
            return handle
        entries = self._new_entries([(g, c, k) for g, c, k, _ in jobs], HostState.PENDING, allocations)
        work = [(entry, entry.generation, blocks) for entry, (_, _, _, blocks) in zip(entries, jobs)]
        self._inflight_stores += len(work)
        if self._disk is not None and self.config.spill_enabled:
            waiting = {entry.key for entry, _, _ in work}
            self._handle_waiting[handle] = waiting
            for key in waiting:
                self._durable_watch.setdefault(key, []).append(handle)
        self._mark_busy([(e.group_index, b) for e, _, blocks in work for b in blocks], handle._released)
        self._spawn(self._run_store(handle, work))
        return handle

    def _store_drop_reason(self, count: int) -> Optional[str]:
        if count == 0:
            return None
        if self._pressure is not None and self._pressure.paused:
            return "pressure"
        if self._inflight_stores + count > self.config.store_queue_max_chunks:
            return "queue_full"
        return None

    def _allocate_slots(self, groups: Iterable[int]) -> Optional[Dict[int, List[int]]]:
        """One host slot per item of ``groups`` (a group index per chunk), all or nothing across
        groups; evicted chunks leave the index. ``None`` when the pools cannot make room."""
        needed: Dict[int, int] = {}
        for gi in groups:
            needed[gi] = needed.get(gi, 0) + 1
        granted: Dict[int, List[int]] = {}
        for gi, count in needed.items():
            allocation = self._pools[gi].allocate(count)
            if allocation is None:
                for g, slots in granted.items():
                    for slot in slots:
                        self._pools[g].release(slot)
                return None
            self._evicted(gi, allocation.evicted)
            granted[gi] = list(allocation.slots)
        return granted

    def _new_entries(self, wanted, state: HostState, slots: Dict[int, List[int]]) -> List[ChunkEntry]:
        """Index an entry per (group, chunk, key) in ``wanted`` in the given slots, pinned once for
        the copy that is about to fill them."""
        iters = {g: iter(s) for g, s in slots.items()}
        entries = []
        for gi, chunk, key in wanted:
            slot = next(iters[gi])
            entry = ChunkEntry(key, gi, chunk, state, slot, ready=self._loop.create_future())
            self._pools[gi].set_owner(slot, entry, key=key)
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
            self._events.append(ChunkEvent("removed", entry.key, group_index, "host"))
            if entry.key not in self._on_disk:
                self.metrics.dropped("evicted", 1)
        if evicted:
            self.metrics.evicted("host", len(evicted))

    async def _run_store(self, handle: StoreHandle, work) -> None:
        started = time.perf_counter()
        batch = [(e.group_index, blocks, self._pools[e.group_index].view(e.slot)) for e, _, blocks in work]
        error: Optional[BaseException] = None
        try:
            await self._loop.run_in_executor(self._d2h, self.device.gather_many_groups, batch)
        except Exception as exc:  # the copy failed: nothing it wrote is trusted
            error = exc
            logger.warning("device -> host copy failed: %s", exc)
        self._inflight_stores -= len(work)
        nbytes = 0
        for entry, generation, _ in work:
            self._unpin(entry)
            if entry.generation != generation or entry.dead:
                continue
            if error is not None or self._closing:
                self._drop_entry(entry, "copy_error" if error is not None else "closed")
                self._resolve_ready(entry, "copy_error" if error is not None else "closed")
                continue
            entry.state = HostState.READY
            nbytes += self._chunk_nbytes[entry.group_index]
            self._resolve_ready(entry, None)
            self._events.append(ChunkEvent("stored", entry.key, entry.group_index, "host"))
            if self._disk is not None and self.config.spill_enabled:
                self._spill_queue.append(entry)
            else:
                self._pools[entry.group_index].mark_evictable(entry.slot, True)
        if nbytes:
            self.metrics.stored("host", len(work), nbytes)
            self.metrics.latency("host", "store", time.perf_counter() - started)
        if not handle._released.done():
            handle._released.set_result(None)
        if error is not None or self._closing or handle not in self._handle_waiting:
            # Not watched (no disk tier, or spill off): the chunks will never be durable.
            self._finish_durable(handle, False)
        if self._spill_queue:
            self._spill_idle.clear()
            self._spill_wakeup.set()

    def _resolve_ready(self, entry: ChunkEntry, reason: Optional[str]) -> None:
        if entry.ready is not None and not entry.ready.done():
            entry.ready.set_result(reason)

    # ------------------------------------------------------------------ spill

    async def _spill_loop(self) -> None:
        """Write-behind: READY host chunks go to disk in batches; a slot becomes evictable only once
        its chunk is on disk (or after a failed spill, when dropping it is deliberate and counted).

        Up to ``_SPILL_BATCHES_IN_FLIGHT`` batches are in flight at once, so the disk tier encodes
        the next batch on its pool while its writer thread commits the previous one; awaiting one
        batch at a time left the disk idle during every encode."""
        in_flight: Set[asyncio.Task] = set()
        try:
            while True:
                if self._spill_queue and len(in_flight) < _SPILL_BATCHES_IN_FLIGHT:
                    batch, batch_bytes = self._next_spill_batch()
                    if batch:
                        in_flight.add(self._loop.create_task(self._spill_batch(batch, batch_bytes)))
                    continue
                if not self._spill_queue and not in_flight:
                    self._spill_idle.set()
                    if self._closing:
                        return
                    await self._spill_wakeup.wait()
                    self._spill_wakeup.clear()
                    continue
                # Pipeline full, or nothing queued while batches are in flight: wait for either.
                wakeup = self._loop.create_task(self._spill_wakeup.wait())
                try:
                    finished, _ = await asyncio.wait([wakeup, *in_flight], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wakeup.cancel()
                self._spill_wakeup.clear()
                for task in finished:
                    if task is wakeup:
                        continue
                    in_flight.discard(task)
                    task.result()  # _spill_batch handles tier errors; anything else is a bug: raise it
        finally:
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)

    def _next_spill_batch(self) -> Tuple[List[ChunkEntry], int]:
        """Take the next batch off the spill queue: up to ``spill_batch_max_chunks`` chunks and
        ``spill_batch_max_bytes`` bytes (at least one chunk), skipping entries that no longer need it."""
        config = self.config
        batch: List[ChunkEntry] = []
        batch_bytes = 0
        while self._spill_queue and len(batch) < config.spill_batch_max_chunks:
            entry = self._spill_queue[0]
            size = self._chunk_nbytes[entry.group_index]
            if batch and batch_bytes + size > config.spill_batch_max_bytes:
                break
            self._spill_queue.popleft()
            if entry.dead or entry.state is not HostState.READY or entry.key in self._on_disk:
                continue
            batch.append(entry)
            batch_bytes += size
        return batch, batch_bytes

    async def _spill_batch(self, batch: List[ChunkEntry], batch_bytes: int) -> None:
        items = []
        for entry in batch:
            entry.spilling = True
            self._pin(entry)
            dtype, shape = self._metas[entry.group_index]
            meta = ChunkMeta(self.fingerprint, entry.group_index, entry.chunk_index, dtype, shape)
            items.append((entry.key, meta, memoryview(self._pools[entry.group_index].view(entry.slot).numpy())))
        started = time.perf_counter()
        error: Optional[BaseException] = None
        try:
            await self._disk.put_many(items)
        except KvtierError as exc:
            error = exc
            logger.warning("spill of %d chunks failed: %s", len(batch), exc)
        except asyncio.CancelledError:
            error = ClosedError("spill cancelled")
            raise
        finally:
            finished = time.perf_counter()
            # Batches are pipelined: one may wait for the batch committed before it, so its own
            # service time starts when that one finished (else the latency signal, and pressure,
            # would double whenever two batches are in flight).
            elapsed = finished - max(started, self._spill_last_done)
            self._spill_last_done = finished
            self._write_latency.observe(elapsed)
            for entry in batch:
                entry.spilling = False
                self._unpin(entry)
                if not entry.dead:
                    # On disk, or deliberately droppable after a failed spill: either way evictable.
                    self._pools[entry.group_index].mark_evictable(entry.slot, True)
                if error is None:
                    self._on_disk.add(entry.key)
                    self._events.append(ChunkEvent("stored", entry.key, entry.group_index, "disk"))
                self._notify_durable(entry.key, error is None)
            if error is None:
                self.metrics.stored("disk", len(batch), batch_bytes)
                self.metrics.latency("disk", "put", elapsed)
            else:
                self.metrics.dropped("tier_error", len(batch))

    def _notify_durable(self, key: bytes, ok: bool) -> None:
        for handle in self._durable_watch.pop(key, ()):
            if not ok:
                self._finish_durable(handle, False)
                continue
            waiting = self._handle_waiting.get(handle)
            if waiting is not None:
                waiting.discard(key)
                if not waiting:
                    self._finish_durable(handle, True)

    def _finish_durable(self, handle: StoreHandle, ok: bool) -> None:
        waiting = self._handle_waiting.pop(handle, set())
        for key in waiting:
            watchers = self._durable_watch.get(key)
            if watchers and handle in watchers:
                watchers.remove(handle)
                if not watchers:
                    del self._durable_watch[key]
        if not handle._durable.done():
            handle._durable.set_result(ok)

    async def flush(self) -> None:
        """Wait until every operation started so far has finished: device copies of stores, their
        spills (with a disk tier), loads and prefetch reads. Cancelling the wait stops nothing."""
        self._check_started()
        while True:
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
                continue
            if self._spill_task is not None and not self._spill_task.done() and (
                self._spill_queue or not self._spill_idle.is_set()
            ):
                self._spill_wakeup.set()
                await self._spill_idle.wait()
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
        again next step.
        """
        self._check_open()
        keys = self._keys(request, salt)
        max_tokens = None if max_tokens is None else check_count("max_tokens", max_tokens, None)
        if max_tokens is None:
            max_tokens = max(0, keys.num_tokens - 1)
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
    ) -> LoadResult:
        """Restore the retained chunks of a hit of ``hit_tokens`` into the device blocks of
        ``block_table`` (same shape as for ``store``; blocks a sliding-window group never restores
        may hold any value). Reads disk -> host slot -> device; concurrent loads of one chunk share
        one read. A chunk that turns out unreadable gives ``LoadResult(ok=False, reason=...)``.

        Cancelling the caller does not stop copies already running: they finish into their slots
        and device blocks, pins are released when they report, and ``fence`` waits for them. A load
        interrupted by ``close`` raises ``ClosedError``.
        """
        self._check_open()
        keys = self._keys(request, salt)
        hit_tokens, block_table = check_load_arguments(self.layout, keys.num_tokens, hit_tokens, block_table)
        if not isinstance(hit_tokens, int) or not 0 <= hit_tokens <= keys.num_tokens:
            raise ValueError(f"hit_tokens must be in [0, {keys.num_tokens}], got {hit_tokens!r}")
        self._check_block_table(block_table)
        jobs = []  # (group, chunk, key, device block per block of the chunk or None)
        missing = False
        for gi in range(len(self.layout.groups)):
            table = block_table[gi]
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
                jobs.append((gi, chunk, key, targets))
        if missing:
            self.metrics.miss("missing")
            return LoadResult(hit_tokens, False, (), reason="missing")
        task = self._spawn(self._load(hit_tokens, jobs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._closing:
                raise ClosedError("the offload engine closed during the load") from None
            raise

    async def _load(self, hit_tokens: int, jobs) -> LoadResult:
        pinned: List[ChunkEntry] = []
        scatter_done: Optional[asyncio.Future] = None
        try:
            entries, from_disk, reason = await self._acquire_chunks([(g, c, k) for g, c, k, _ in jobs], pinned)
            if reason is not None:
                self.metrics.miss(reason)
                return LoadResult(hit_tokens, False, (), reason=reason)
            if self._closing:
                raise ClosedError("the offload engine closed during the load")
            batch = []
            loaded: List[Tuple[int, int]] = []
            for (gi, chunk, _key, targets), entry in zip(jobs, entries):
                batch.append((gi, self._pools[gi].view(entry.slot), targets))
                per_chunk = self.layout.groups[gi].blocks_per_chunk
                loaded.extend((gi, chunk * per_chunk + i) for i, t in enumerate(targets) if t is not None)
                self._pools[gi].touch(entry.slot)
            scatter_done = self._loop.create_future()
            self._mark_busy([(g, t) for g, _, targets in batch for t in targets if t is not None], scatter_done)
            started = time.perf_counter()
            await self._loop.run_in_executor(self._h2d, self.device.scatter_many_groups, batch)
            nbytes = sum(self._chunk_nbytes[g] for g, _, _ in batch)
            self.metrics.loaded("device", len(batch), nbytes)
            self.metrics.latency("device", "load", time.perf_counter() - started)
            if self._closing:
                raise ClosedError("the offload engine closed during the load")
            return LoadResult(
                hit_tokens, True, tuple(loaded), chunks_from_disk=from_disk, chunks_from_host=len(jobs) - from_disk
            )
        finally:
            if scatter_done is not None and not scatter_done.done():
                scatter_done.set_result(None)
            for entry in pinned:
                self._unpin(entry)

    async def _acquire_chunks(self, wanted, pinned: List[ChunkEntry]):
        """Pin a host entry for every wanted chunk, promoting disk-only chunks (single flight).
        Returns (entries, chunks read from disk, failure reason or None)."""
        entries: List[Optional[ChunkEntry]] = []
        to_promote = []
        for gi, chunk, key in wanted:
            entry = self._entries.get(key)
            if entry is None:
                if key not in self._on_disk:
                    return [], 0, "missing"
                to_promote.append((gi, chunk, key))
                entries.append(None)
                continue
            self._pin(entry)
            pinned.append(entry)
            entries.append(entry)
        promoted: List[ChunkEntry] = []
        if to_promote:
            promoted = self._start_promotion(to_promote)
            if promoted is None:
                return [], 0, "host_full"
            for entry in promoted:
                self._pin(entry)
                pinned.append(entry)
            it = iter(promoted)
            entries = [e if e is not None else next(it) for e in entries]
        waits = [e.ready for e in entries if e.state is not HostState.READY]
        if waits:
            try:
                reasons = await asyncio.wait_for(
                    asyncio.gather(*(asyncio.shield(w) for w in waits)), self.config.tier_timeout_s
                )
            except asyncio.TimeoutError:
                for entry in entries:
                    if entry.state is HostState.LOADING:
                        self._abandon(entry, "timeout")
                return [], 0, "timeout"
            failed = [r for r in reasons if r is not None]
            if failed:
                return [], 0, failed[0]
        return entries, len(promoted), None

    def _start_promotion(self, wanted) -> Optional[List[ChunkEntry]]:
        """Allocate slots and start one disk read for ``wanted`` (group, chunk, key) chunks; the
        read runs in an engine-owned task, so no caller's cancellation can cut it short."""
        slots = self._allocate_slots(g for g, _, _ in wanted)
        if slots is None:
            return None
        # The read's own pin is held until the worker reports.
        entries = self._new_entries(wanted, HostState.LOADING, slots)
        self._spawn(self._promote([(e, e.generation) for e in entries]))
        return entries

    async def _promote(self, work: List[Tuple[ChunkEntry, int]]) -> None:
        items = [(e.key, memoryview(self._pools[e.group_index].view(e.slot).numpy())) for e, _ in work]
        started = time.perf_counter()
        try:
            # A miss is "corrupt" only when the tier counted a bad record meanwhile; else the record
            # is gone (another process's gc, an eviction the index has not heard of): "missing".
            bad_before = _bad_reads(self._disk)
            metas = await self._disk.get_many_into(items)
            failure = "corrupt" if _bad_reads(self._disk) != bad_before else "missing"
        except KvtierError as exc:
            logger.warning("disk read of %d chunks failed: %s", len(items), exc)
            metas, failure = [None] * len(items), "tier_error"
        nbytes = 0
        for (entry, generation), meta in zip(work, metas):
            self._unpin(entry)
            if entry.generation != generation or entry.dead:
                continue  # abandoned (timeout or close): the late result is discarded
            expected_dtype, expected_shape = self._metas[entry.group_index]
            if meta is not None and (
                meta.fingerprint != self.fingerprint
                or meta.group_index != entry.group_index
                or meta.chunk_index != entry.chunk_index
                or meta.dtype != expected_dtype
                or tuple(meta.shape) != expected_shape
            ):
                meta, failure = None, "corrupt"
            if meta is None:
                self._on_disk.discard(entry.key)
                self._drop_entry(entry, None)
                self._resolve_ready(entry, failure)
                continue
            entry.state = HostState.READY
            nbytes += self._chunk_nbytes[entry.group_index]
            self._pools[entry.group_index].mark_evictable(entry.slot, True)
            self._events.append(ChunkEvent("stored", entry.key, entry.group_index, "host"))
            self._resolve_ready(entry, None)
        if nbytes:
            self.metrics.loaded("disk", len(work), nbytes)
            self.metrics.latency("disk", "get", time.perf_counter() - started)

    def _abandon(self, entry: ChunkEntry, reason: str) -> None:
        """Give up on an in-flight read: waiters fail now; the slot stays reserved (pinned by the
        read) until the worker reports, and its late result is discarded by generation."""
        entry.generation += 1
        self._drop_entry(entry, None)
        self._resolve_ready(entry, reason)

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
        landed by then. Paused under memory pressure (returns 0). Cancelling the wait does not stop
        the reads; they still land in the host tier.
        """
        self._check_open()
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {policy!r}")
        if policy == "timeout" and (timeout_s is None or timeout_s <= 0):
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
                if key is not None and key not in self._entries and key in self._on_disk:
                    wanted.append((gi, chunk, key))
        if not wanted:
            return 0
        entries = self._start_promotion(wanted)
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
        group when ``group_index`` is None). Cancelling the wait stops no copy."""
        blocks = list(block_ids)
        groups = range(len(self.layout.groups)) if group_index is None else [group_index]
        wanted = {(gi, int(block)) for gi in groups for block in blocks}
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
        """Remove an entry from the index; its slot is released when its last pin goes."""
        if entry.dead:
            return
        entry.dead = True
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
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

    def _check_block_table(self, block_table: BlockTable) -> None:
        if len(block_table) != len(self.layout.groups):
            raise ValueError(
                f"block_table must have one list per group ({len(self.layout.groups)}), got {len(block_table)}"
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
        """Stored/removed chunk events since the last call (key, group, tier), oldest first."""
        events, self._events = self._events, []
        return events

    def statistics(self) -> Dict[str, Any]:
        """Counters and gauges as plain numbers: metrics, chunks per state, tiers, pressure."""
        states = {state.value: 0 for state in HostState}
        for entry in self._entries.values():
            states[entry.state.value] += 1
        stats: Dict[str, Any] = dict(self.metrics.snapshot())
        stats["chunks_by_state"] = states
        stats["chunks_on_disk"] = len(self._on_disk)
        stats["host"] = [pool.statistics() for pool in self._pools]
        stats["disk"] = self._disk.statistics().as_dict() if self._disk is not None else None
        stats["pressure"] = self._pressure.state if self._pressure is not None else "unknown"
        stats["inflight_stores"] = self._inflight_stores
        stats["spill_queue"] = len(self._spill_queue)
        return stats

    def check(self) -> None:
        """Reconcile entries, pins and host slots; raise ``EngineInvariantError`` listing every
        disagreement. Meant for test teardown and the end of stress runs, when the engine is idle."""
        problems: List[str] = []
        owned: Dict[Tuple[int, int], ChunkEntry] = {}
        for key, entry in self._entries.items():
            if entry.key != key:
                problems.append(f"entry under key {key.hex()[:12]} names {entry.key.hex()[:12]}")
            if entry.dead:
                problems.append(f"dead entry {key.hex()[:12]} still indexed")
            if entry.pins < 0:
                problems.append(f"entry {key.hex()[:12]} has {entry.pins} pins")
            where = (entry.group_index, entry.slot)
            if where in owned:
                problems.append(f"slot {where} owned twice")
            owned[where] = entry
        idle = not self._tasks and not self._spill_queue and (self._spill_idle is None or self._spill_idle.is_set())
        if idle:
            for key, entry in self._entries.items():
                if entry.state is not HostState.READY:
                    problems.append(f"entry {key.hex()[:12]} stuck in {entry.state.value}")
                if entry.pins != 0:
                    problems.append(f"entry {key.hex()[:12]} still has {entry.pins} pins while idle")
            for gi, pool in enumerate(self._pools):
                stats = pool.statistics()
                used = sum(1 for g, _ in owned if g == gi)
                if stats["used_slots"] != used:
                    problems.append(f"group {gi}: pool has {stats['used_slots']} slots in use but {used} entries")
                if stats["pinned_slots"] != 0:
                    problems.append(f"group {gi}: {stats.get('pinned_slots')} slots pinned while idle")
            if self._inflight_stores != 0:
                problems.append(f"{self._inflight_stores} stores in flight while idle")
            if self._busy_batches:
                fenced = set().union(*self._busy_batches.values())
                problems.append(f"{len(fenced)} device blocks still fenced while idle")
        for gi, pool in enumerate(self._pools):
            try:
                pool.check()
            except KvtierError as exc:
                problems.append(f"group {gi} host pool: {exc}")
        if problems:
            raise EngineInvariantError("; ".join(problems))


def _bad_reads(tier: ChunkTier) -> int:
    stats = tier.statistics()
    return int(getattr(stats, "corrupt", 0)) + int(getattr(stats, "mismatched", 0))
