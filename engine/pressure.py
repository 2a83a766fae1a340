"""Memory-pressure monitor: poll used-fractions off the hot path, pause and resume with hysteresis.

Primitives and the thread each runs on:

- A *source* is any callable ``() -> float | None``: a used fraction in [0, 1], or ``None`` when it
  cannot tell ("unknown"). A source may carry an ``unknown_reason`` attribute that says why; the
  monitor logs it once. Sources are called on the monitor's polling thread (or the caller's thread
  for ``poll_once``), never on the event loop once ``start()`` runs, so a slow NVML call cannot
  stall it. They must therefore be thread-safe.
- ``nvml_device_memory_source(device_index)``: device memory used / total through NVML
  (``nvidia-ml-py``). No library, no driver, no GPU or any NVML error: ``None``, reason
  "NVML unavailable (...)".
- ``nvml_device_headroom_source(need_bytes, uuid=...)``: the engine's device signal on CUDA: the
  part of the room its staging buffers need that is not free (a pre-reserved pool at 92% with
  gigabytes free reads near 0; an allocation that leaves no room reads 1), the GPU found by UUID.
- ``host_memory_source()``: host memory in use (``psutil.virtual_memory().percent / 100``).
- ``LatencyEwma(alpha, high_latency_s)``: a tier's write latency as a moving average; tiers and the
  engine ``observe(seconds)`` from any thread; as a source it reads ``latency / high_latency_s``
  clipped to [0, 1].
- scripted sources for tests (``ScriptedSource``, ``FakeNvml``) live in ``kvtier.tools.testing``.
- ``PressureMonitor``: the state machine. ``poll_once()`` reads and applies synchronously;
  ``start()`` polls every ``poll_interval_s`` on a dedicated one-thread executor and applies each
  result on the event-loop thread (the task resumes there after ``run_in_executor``, which hands
  results over with ``call_soon_threadsafe``). State, counters and ``on_change`` calls all live on
  that one thread.

States: ``"normal"``, ``"high"`` (``paused``: the engine pauses prefetch and promotions and drops,
counting them, new stores) and ``"unknown"`` (no source has a reading: the engine runs as under
normal pressure, and the monitor says so once). ``"high"`` is entered when any known source reaches
the high watermark and left only when every known source is at or below the low watermark, so a
signal hovering at one watermark does not flap.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type

__all__ = [
    "PressureSource",
    "PressureMonitor",
    "LatencyEwma",
    "nvml_device_memory_source",
    "nvml_device_headroom_source",
    "device_memory_source_for",
    "host_memory_source",
    "default_sources",
    "NORMAL",
    "HIGH",
    "UNKNOWN",
]

logger = logging.getLogger(__name__)

PressureSource = Callable[[], Optional[float]]
OnChange = Callable[[str, str], Any]

NORMAL = "normal"
HIGH = "high"
UNKNOWN = "unknown"


# -- sources --------------------------------------------------------------------------------------


# Reasons an optional source (NVML on a CPU engine) was unknown, said once per process: every engine
# a CPU process starts would otherwise repeat it.
_OPTIONAL_UNKNOWN_LOGGED: set = set()


class _NvmlDeviceMemorySource:
    """Device memory used / total of one GPU through NVML. See ``nvml_device_memory_source``."""

    def __init__(self, device_index: int, nvml: Any = None, optional: bool = False, uuid: Optional[str] = None,
                 need_bytes: Optional[int] = None, reusable_bytes: Optional[Callable[[], int]] = None) -> None:
        self.device_index = device_index
        self.uuid = uuid
        self.need_bytes = need_bytes
        self._reusable_bytes = reusable_bytes
        self.optional = optional
        self.unknown_reason: Optional[str] = None
        self._nvml = nvml
        self._handle: Any = None
        # Set once init or the handle lookup failed: neither a library nor a driver appears while
        # the process runs, and retrying would cost a dlopen per poll.
        self._broken = False
        self._lock = threading.Lock()

    def __call__(self) -> Optional[float]:
        with self._lock:
            if self._broken:
                return None
            if self._handle is None and not self._open():
                return None
            nvml = self._nvml
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(self._handle)
            except _nvml_errors(nvml) as exc:
                # A query error may be transient (GPU reset, Xid): unknown now, ask again next poll.
                self.unknown_reason = f"NVML unavailable ({_describe(exc)})"
                return None
            if not info.total:
                self.unknown_reason = "NVML unavailable (device reports 0 bytes of memory)"
                return None
            self.unknown_reason = None
            if self.need_bytes is None:
                return info.used / info.total
            free = max(0, int(info.total) - int(info.used))
            if self._reusable_bytes is not None:
                try:
                    free += max(0, int(self._reusable_bytes()))
                except Exception as exc:  # noqa: BLE001 - an allocator query failing is no pressure
                    logger.debug("reusable device bytes unavailable: %r", exc)
            return min(1.0, self.need_bytes / free) if free else 1.0

    def _open(self) -> bool:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                return self._fail(f"NVML unavailable (nvidia-ml-py not importable: {exc})")
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()  # once per source; NVML reference-counts init.
            if self.uuid is not None:
                # NVML numbers GPUs without CUDA_VISIBLE_DEVICES: torch's index can name another one.
                self._handle = nvml.nvmlDeviceGetHandleByUUID(self.uuid)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except _nvml_errors(nvml) as exc:
            return self._fail(f"NVML unavailable ({_describe(exc)})")
        return True

    def _fail(self, reason: str) -> bool:
        self._broken = True
        self.unknown_reason = reason
        return False

    def __repr__(self) -> str:
        if self.need_bytes is not None:
            return f"nvml_device_headroom_source(need_bytes={self.need_bytes}, uuid={self.uuid!r})"
        return f"nvml_device_memory_source(device_index={self.device_index})"


def _nvml_errors(nvml: Any) -> Tuple[Type[BaseException], ...]:
    # OSError: a driver library that exists but does not load.
    return (getattr(nvml, "NVMLError", OSError), OSError)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def nvml_device_memory_source(device_index: int = 0, *, nvml: Any = None, optional: bool = False,
                              uuid: Optional[str] = None) -> PressureSource:
    """A source reading device ``device_index``'s memory used / total through NVML.

    NVML is initialised once, lazily, on the first call (so on the polling thread). Without
    ``nvidia-ml-py``, without a driver or GPU, or on any NVML error the source returns ``None`` and
    its ``unknown_reason`` says "NVML unavailable (...)". A failed init is not retried; a failed
    query is. ``nvml`` replaces the ``pynvml`` module (tests pass a fake). ``optional``: no GPU is
    expected (a CPU engine), so an unavailable NVML is said once per process at INFO, not as a
    warning on every start.
    """
    if not isinstance(device_index, int) or isinstance(device_index, bool) or device_index < 0:
        raise ValueError(f"device_index must be a non-negative int, got {device_index!r}")
    return _NvmlDeviceMemorySource(device_index, nvml, optional, uuid)


def nvml_device_headroom_source(
    need_bytes: int,
    *,
    uuid: Optional[str] = None,
    device_index: int = 0,
    reusable_bytes: Optional[Callable[[], int]] = None,
    nvml: Any = None,
    optional: bool = False,
) -> PressureSource:
    """A source reading how much of the room kvtier's copies need is missing on one GPU:
    ``need_bytes / (NVML's free bytes + reusable_bytes())``, clipped to 1.

    NVML's "used" counts memory a serving process reserves up front (vLLM takes 90% by default),
    so used/total says nothing about whether offload can run: at a constant 92% with gigabytes
    free, stores must go on. What offload needs on the device is its staging buffers
    (``need_bytes``); ``reusable_bytes`` adds what torch's caching allocator holds unallocated in
    this process (staging can reuse it). Under the monitor's watermarks (0.90 / 0.80) stores pause
    once free room falls under ~1.1x the need and resume above 1.25x. ``uuid`` ("GPU-...") names
    the GPU as NVML sees it (``CUDA_VISIBLE_DEVICES`` renumbers torch's indices, not NVML's);
    without it ``device_index`` is NVML's index. Errors and ``optional`` as for
    ``nvml_device_memory_source``.
    """
    if not isinstance(need_bytes, int) or isinstance(need_bytes, bool) or need_bytes < 1:
        raise ValueError(f"need_bytes must be a positive int, got {need_bytes!r}")
    return _NvmlDeviceMemorySource(device_index, nvml, optional, uuid, need_bytes, reusable_bytes)


class _HostMemorySource:
    def __init__(self, own_bytes: Optional[Callable[[], int]] = None) -> None:
        self.unknown_reason: Optional[str] = None
        self._own_bytes = own_bytes

    def __call__(self) -> Optional[float]:
        try:
            import psutil

            memory = psutil.virtual_memory()
            own = int(self._own_bytes()) if self._own_bytes is not None else 0
        except Exception as exc:  # psutil missing or /proc unreadable: unknown, not fatal
            self.unknown_reason = f"host memory unavailable ({_describe(exc)})"
            return None
        self.unknown_reason = None
        if not memory.total:
            return None
        return max(0.0, min(1.0, (memory.total - memory.available - own) / memory.total))

    def __repr__(self) -> str:
        return "host_memory_source()"


def device_memory_source_for(view: Any) -> PressureSource:
    """The engine's device signal for a ``DeviceKVView``: on CUDA the headroom its staging buffers
    need (both directions), the GPU found by UUID, the caching allocator's unused bytes counted as
    room; on CPU NVML is still asked (device 0, optional), its absence said once at INFO."""
    backend = view.backend
    if not backend.is_cuda:
        return nvml_device_memory_source(0, optional=True)
    return nvml_device_headroom_source(2 * max(1, view.staging_nbytes), uuid=backend.device_uuid(),
                                       reusable_bytes=backend.reusable_device_bytes)


def host_memory_source(own_bytes: Optional[Callable[[], int]] = None) -> PressureSource:
    """A source reading host memory in use by *others*: ``(total - available - own) / total``.

    psutil's ``available`` counts page cache that can be dropped as free, which is the pressure
    that matters for a pinned slab. ``own_bytes()`` is memory the caller already holds (the
    engine passes its host slabs, pre-faulted at start): counting it would let a large slab keep
    the reading high by itself, and the engine would drop every store for good.
    """
    return _HostMemorySource(own_bytes)


class LatencyEwma:
    """A tier's write latency as an exponential moving average, usable as a pressure source.

    ``observe(seconds)`` (any thread) folds one completed write in with weight ``alpha``; the first
    observation is taken as is. As a source it returns ``average / high_latency_s`` clipped to
    [0, 1], and 0.0 before any write (no write, no write pressure).

    While no write completes the reading decays, halving every ``idle_half_life_s``: under high
    pressure the engine drops new stores, so writes stop, and an average frozen at its last value
    would keep the engine paused forever. The cost is that one write slower than the half-life
    reads lower while it is still in flight. ``None`` disables the decay.
    """

    def __init__(
        self,
        alpha: float,
        high_latency_s: float,
        *,
        idle_half_life_s: Optional[float] = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not isinstance(high_latency_s, (int, float)) or not 0.0 < high_latency_s < math.inf:
            raise ValueError(f"high_latency_s must be a positive, finite number, got {high_latency_s!r}")
        if idle_half_life_s is not None and not (
            isinstance(idle_half_life_s, (int, float)) and 0.0 < idle_half_life_s < math.inf
        ):
            raise ValueError(
                f"idle_half_life_s must be a positive, finite number or None, got {idle_half_life_s!r}"
            )
        self.alpha = float(alpha)
        self.high_latency_s = float(high_latency_s)
        self.idle_half_life_s = None if idle_half_life_s is None else float(idle_half_life_s)
        self.unknown_reason: Optional[str] = None
        self._clock = clock
        self._lock = threading.Lock()
        self._average_s: Optional[float] = None
        self._last_observed = 0.0
        self._count = 0

    def observe(self, seconds: float) -> None:
        """Fold in the duration of one completed write (or batch), in seconds."""
        if not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        now = self._clock()
        with self._lock:
            if self._average_s is None:
                self._average_s = float(seconds)
            else:
                decayed = self._decayed(now)
                self._average_s = decayed + self.alpha * (seconds - decayed)
            self._last_observed = now
            self._count += 1

    def _decayed(self, now: float) -> float:
        # Called with the lock held, after at least one observation.
        average = self._average_s or 0.0
        if self.idle_half_life_s is None:
            return average
        idle = max(0.0, now - self._last_observed)
        return average * 0.5 ** (idle / self.idle_half_life_s)

    @property
    def average_s(self) -> Optional[float]:
        """The current (decayed) average latency in seconds; ``None`` before any observation."""
        with self._lock:
            if self._average_s is None:
                return None
            return self._decayed(self._clock())

    @property
    def count(self) -> int:
        """Observations so far."""
        return self._count

    def fraction(self) -> float:
        """The pressure reading: ``average_s / high_latency_s`` clipped to [0, 1]; 0.0 before any
        write. Calling the object does the same, so either can serve as a source."""
        average = self.average_s
        if average is None:
            return 0.0
        return min(1.0, average / self.high_latency_s)

    __call__ = fraction

    def __repr__(self) -> str:
        return f"LatencyEwma(alpha={self.alpha}, high_latency_s={self.high_latency_s})"


def default_sources(
    device_index: Optional[int] = 0,
    latencies: Optional[Mapping[str, LatencyEwma]] = None,
) -> Dict[str, PressureSource]:
    """The standard set: ``"device_memory"`` (NVML, left out when ``device_index`` is ``None``, as
    on a CPU engine), ``"host_memory"``, and ``"<tier>_write_latency"`` for each given average."""
    sources: Dict[str, PressureSource] = {}
    if device_index is not None:
        sources["device_memory"] = nvml_device_memory_source(device_index)
    sources["host_memory"] = host_memory_source()
    for tier, ewma in (latencies or {}).items():
        sources[f"{tier}_write_latency"] = ewma
    return sources


# -- the monitor ----------------------------------------------------------------------------------

# One reading: the used fraction (None when unknown) and, when unknown, why.
_Reading = Tuple[Optional[float], Optional[str]]


class PressureMonitor:
    """Polls pressure sources and keeps a ``normal`` / ``high`` / ``unknown`` state with hysteresis.

    ``on_change(old_state, new_state)`` is called on every state change, on the thread that applies
    it (the event-loop thread once ``start()`` runs); an exception from it is logged, not raised.
    Before the first poll the state is ``"unknown"`` (nothing measured yet), which does not pause.
    """

    def __init__(
        self,
        sources: Mapping[str, PressureSource],
        high_fraction: float = 0.90,
        low_fraction: float = 0.80,
        poll_interval_s: float = 1.0,
        on_change: Optional[OnChange] = None,
    ) -> None:
        for name, value in (("high_fraction", high_fraction), ("low_fraction", low_fraction)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if not low_fraction < high_fraction:
            raise ValueError(
                f"low_fraction must be < high_fraction (the band is the hysteresis), got "
                f"low={low_fraction!r}, high={high_fraction!r}"
            )
        if (
            not isinstance(poll_interval_s, (int, float))
            or isinstance(poll_interval_s, bool)
            or not 0.0 < poll_interval_s < math.inf
        ):
            raise ValueError(f"poll_interval_s must be a positive, finite number, got {poll_interval_s!r}")
        for name, source in sources.items():
            if not callable(source):
                raise ValueError(f"source {name!r} must be callable, got {source!r}")
        self._sources: Dict[str, PressureSource] = dict(sources)
        self.high_fraction = float(high_fraction)
        self.low_fraction = float(low_fraction)
        self.poll_interval_s = float(poll_interval_s)
        self.on_change = on_change

        self._state = UNKNOWN
        self._readings: Dict[str, Optional[float]] = {}
        self._transitions = 0
        self._polls = 0
        self._unknown_logged: set = set()
        self._all_unknown_logged = False

        self._task: Optional[asyncio.Task] = None
        self._executor: Optional[ThreadPoolExecutor] = None

    # -- observed state ------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"normal"``, ``"high"`` or ``"unknown"``."""
        return self._state

    @property
    def paused(self) -> bool:
        """True while pressure is high: pause prefetch and promotions, drop new stores."""
        return self._state == HIGH

    @property
    def readings(self) -> Dict[str, Optional[float]]:
        """The last poll's fraction per source (``None``: unknown). A copy."""
        return dict(self._readings)

    @property
    def transitions(self) -> int:
        """How many times ``paused`` changed (pauses plus resumes); moves to and from "unknown"
        that do not change ``paused`` are not counted."""
        return self._transitions

    @property
    def polls(self) -> int:
        """Polls applied so far."""
        return self._polls

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- polling -------------------------------------------------------------------------------

    def poll_once(self) -> str:
        """Read every source on this thread, apply the result, return the new state.

        For tests and for callers without a loop; while ``start()`` runs, call it only from the
        event-loop thread (state belongs to that thread).
        """
        return self._apply(self._read())

    def _read(self) -> Dict[str, _Reading]:
        """Call every source. Runs on the polling thread; touches no monitor state."""
        readings: Dict[str, _Reading] = {}
        for name, source in self._sources.items():
            try:
                value = source()
            except Exception as exc:  # a broken source is an unknown one, never a dead monitor
                readings[name] = (None, f"source {name!r} raised {_describe(exc)}")
                continue
            if value is None:
                reason = getattr(source, "unknown_reason", None) or f"source {name!r} has no reading"
                readings[name] = (None, reason)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                readings[name] = (None, f"source {name!r} returned {value!r}, not a fraction")
            else:
                readings[name] = (min(1.0, max(0.0, float(value))), None)
        return readings

    def _apply(self, readings: Mapping[str, _Reading]) -> str:
        """Fold one poll into the state machine. Runs on the state's thread."""
        self._polls += 1
        self._readings = {name: value for name, (value, _) in readings.items()}
        for name, (value, reason) in readings.items():
            if value is None and name not in self._unknown_logged:
                self._unknown_logged.add(name)
                if not getattr(self._sources.get(name), "optional", False):
                    logger.warning("pressure unknown: %s", reason)
                elif reason not in _OPTIONAL_UNKNOWN_LOGGED:
                    _OPTIONAL_UNKNOWN_LOGGED.add(reason)
                    logger.info("pressure unknown: %s (expected without a GPU)", reason)

        known = {name: value for name, (value, _) in readings.items() if value is not None}
        old = self._state
        if not known:
            new = UNKNOWN
        elif any(value >= self.high_fraction for value in known.values()):
            new = HIGH
        elif old == HIGH and any(value > self.low_fraction for value in known.values()):
            new = HIGH  # inside the band: stay paused until every known source is at or below low
        else:
            new = NORMAL
        if new == UNKNOWN and not self._all_unknown_logged:
            # Said once per monitor, whether or not the state changed (it starts "unknown").
            self._all_unknown_logged = True
            logger.warning("no source gives a memory-pressure reading; running as under normal pressure")
        if new == old:
            return new

        self._state = new
        if (old == HIGH) != (new == HIGH):
            self._transitions += 1
        self._log_change(old, new, known)
        if self.on_change is not None:
            try:
                self.on_change(old, new)
            except Exception:
                logger.exception("pressure on_change callback failed (%s -> %s)", old, new)
        return new

    def _log_change(self, old: str, new: str, known: Mapping[str, float]) -> None:
        shown = ", ".join(f"{name}={value:.3f}" for name, value in sorted(known.items()))
        if new == HIGH:
            logger.warning(
                "memory pressure high (%s; high watermark %.2f): pausing prefetch and promotions, "
                "dropping new stores",
                shown,
                self.high_fraction,
            )
        elif new == NORMAL and old == HIGH:
            logger.info(
                "memory pressure back to normal (%s; low watermark %.2f): resuming",
                shown,
                self.low_fraction,
            )
        elif new == UNKNOWN:
            logger.debug("memory pressure unknown after %s: running as under normal pressure", old)

    # -- background polling ----------------------------------------------------------------------

    async def start(self) -> None:
        """Poll now and then every ``poll_interval_s`` in the background until ``stop()``.

        Sources run on a dedicated one-thread executor, so a slow NVML call never blocks the event
        loop nor waits behind tier work in the default executor. Safe to call twice.
        """
        if self.running:
            return
        loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-pressure")
        self._task = loop.create_task(self._run(self._executor), name="kvtier-pressure-monitor")

    async def stop(self) -> None:
        """Stop polling. Safe to call twice, and before ``start()``.

        A source call already running on the polling thread is not interrupted (threads cannot be);
        its result is discarded.
        """
        task, executor = self._task, self._executor
        self._task = self._executor = None
        if task is not None:
            task.cancel()
            # wait() neither raises the task's CancelledError nor swallows our caller's own.
            await asyncio.wait({task})
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                readings = await loop.run_in_executor(executor, self._read)
            except asyncio.CancelledError:
                raise
            except Exception:  # pragma: no cover - _read catches source errors itself
                logger.exception("pressure poll failed")
            else:
                self._apply(readings)  # back on the event-loop thread
            await asyncio.sleep(self.poll_interval_s)

    def __repr__(self) -> str:
        return (
            f"PressureMonitor(state={self._state!r}, sources={sorted(self._sources)}, "
            f"high={self.high_fraction}, low={self.low_fraction})"
        )
