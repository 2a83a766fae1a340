"""What ``OffloadEngine.start`` builds before the engine serves: the host pools, the spill, store
and load paths, and the pressure monitor.

Primitives: ``PoolsFactory`` (the type of the ``host_pools=`` hook), ``make_host_pools`` (the host
pools of the view's device kind, page-locked on CUDA; runs on a worker thread, since pre-faulting
and registering a large slab takes seconds), ``build_paths`` (the spill pipeline, ``StorePath`` and
``LoadPath``, each handed the host bookkeeping and the collaborators it uses) and
``pressure_monitor`` (the monitor over the host, device and disk-write-latency sources, not
started), ``start_loop`` (a background loop under ``Supervised``, its crashes counted) and
``refresh_loop`` (the periodic disk-index refresh). Everything but ``make_host_pools`` runs on the
engine's event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Any, Awaitable, Callable, Coroutine, Dict, List, Mapping, Optional, Sequence, Tuple

from kvtier.errors import ClosedError
from kvtier.policy import ModelLayout
from kvtier.tiers.base import ChunkTier

from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.host import HostSlabPool, host_split_weights, pools_for_budget

from .config import EngineConfig
from .disk_index import DiskIndex
from .drop_log import DropLog
from .durable import DurableWatch
from .events import EventLog
from .host_book import HostBook
from .loading import LoadPath
from .metrics import EngineMetrics
from .pressure import LatencyEwma, PressureMonitor, device_memory_source_for, host_memory_source
from .spill import SpillPipeline
from .storing import StorePath
from .tasks import Supervised
from .validation import check_device_kind, check_pools_pinned

__all__ = ["PoolsFactory", "make_host_pools", "build_paths", "pressure_monitor", "start_loop", "refresh_loop"]

logger = logging.getLogger("kvtier.engine")

# Makes the host pools: (bytes of one chunk per group, device_kind=, eviction=) -> one pool per group.
PoolsFactory = Callable[..., List[HostSlabPool]]


def make_host_pools(config: EngineConfig, device: DeviceKVView, chunk_bytes: Sequence[int],
                    factory: Optional[PoolsFactory] = None) -> List[HostSlabPool]:
    """The host pools (``factory``, else the host budget split by ``pools_for_budget`` in proportion
    to the bytes each group stores per token under the retention interval, ``host_split_weights``),
    of the view's device kind; on CUDA they must be page-locked. Runs on a worker thread."""
    check_device_kind(config.device_kind, device)
    retention = config.store_retention_interval_tokens
    make = factory or (lambda sizes, **kw: pools_for_budget(
        config.host_capacity_bytes, sizes, weights=host_split_weights(device.layout, sizes, retention), **kw))
    # The view's own device ("cuda:1"): the slab is registered with that device current.
    pools = make(list(chunk_bytes), device_kind=str(device.device), eviction=config.host_policy())
    check_pools_pinned(device, pools)
    return pools


def build_paths(host: HostBook, disk: Optional[ChunkTier], index: DiskIndex, watch: DurableWatch, *,
                config: EngineConfig, layout: ModelLayout, device: DeviceKVView, metrics: EngineMetrics,
                events: EventLog, write_latency: LatencyEwma, drop_log: DropLog,
                spawn: Callable[[Coroutine], asyncio.Task], closing: Callable[[], bool], paused: Callable[[], bool],
                d2h: Executor, h2d: Executor) -> Tuple[Optional[SpillPipeline], StorePath, LoadPath]:
    """The spill pipeline (with a disk tier, else ``None``), the store path (stores copy on ``d2h``)
    and the load path (loads copy on ``h2d``). ``closing`` and ``paused`` are read when a path
    asks, not now. Runs on the engine's loop, in ``start``."""
    spill = None
    if disk is not None:
        spill = SpillPipeline(host, disk, index, watch, config=config, metrics=metrics, events=events,
                              write_latency=write_latency, closing=closing)
    common: Dict[str, Any] = dict(layout=layout, config=config, device=device, loop=asyncio.get_running_loop(),
                                  metrics=metrics, events=events, spawn=spawn, closing=closing)
    stores = StorePath(host, index, watch, spill if config.spill_enabled else None, executor=d2h,
                       has_disk=disk is not None, drop_log=drop_log, paused=paused, **common)
    loads = LoadPath(host, index, disk, executor=h2d, write_back=stores.write_back, **common)
    return spill, stores, loads


def pressure_monitor(config: EngineConfig, device: DeviceKVView,
                     sources: Optional[Mapping[str, Callable[[], Optional[float]]]], *,
                     own_bytes: Callable[[], int], write_latency: LatencyEwma) -> PressureMonitor:
    """The engine's pressure monitor: ``sources`` (default: host memory less the engine's own
    slabs, and the view's device memory) plus the disk write latency. Event-loop thread."""
    if sources is None:
        sources = {"host_memory": host_memory_source(own_bytes=own_bytes),
                   "device_memory": device_memory_source_for(device)}
    sources = dict(sources)
    sources.setdefault("disk_write_latency", write_latency.fraction)
    return PressureMonitor(
        sources,
        high_fraction=config.pressure_high_watermark_fraction,
        low_fraction=config.pressure_low_watermark_fraction,
        poll_interval_s=config.pressure_poll_interval_s,
    )


def start_loop(name: str, factory: Callable[[], Coroutine[Any, Any, None]], *, metrics: EngineMetrics,
               closing: Callable[[], bool], on_give_up: Callable[[BaseException], None]) -> Supervised:
    """Start ``factory()`` as the supervised task ``kvtier-{name}``, restarted while the engine is
    not ``closing``; each crash counts a ``{name}_loop`` worker error."""
    def crashed(exc: BaseException) -> None:
        metrics.worker_error(f"{name.replace('-', '_')}_loop")

    runner = Supervised(f"kvtier-{name}", factory, running=lambda: not closing(), on_crash=crashed,
                        on_give_up=on_give_up)
    runner.start()
    return runner


async def refresh_loop(interval: float, refresh: Callable[[], Awaitable[Any]], *, metrics: EngineMetrics,
                       closing: Callable[[], bool]) -> None:
    """Call ``refresh()`` every ``interval`` seconds until ``closing()`` or a ``ClosedError``; a
    failed refresh is logged and counted, and the engine keeps serving on the index it has."""
    while not closing():
        await asyncio.sleep(interval)
        try:
            await refresh()
        except ClosedError:
            return
        except Exception as exc:  # keep serving on the index we have; try again next time
            logger.warning("refreshing the disk index failed: %r", exc)
            metrics.worker_error("refresh")
