"""PressureMonitor: hysteresis on scripted curves, unknown sources logged once, background polling."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from types import SimpleNamespace

import pytest

from kvtier.engine.pressure import (
    LatencyEwma,
    PressureMonitor,
    default_sources,
    host_memory_source,
    nvml_device_memory_source,
)
from kvtier.engine.pressure import nvml_device_headroom_source
from kvtier.tools.testing.pressure import FakeNvml, FakeNvmlLibrary, ScriptedSource

LOGGER = "kvtier.engine.pressure"


def run_curve(values, high=0.9, low=0.8):
    monitor = PressureMonitor({"device": ScriptedSource(values)}, high_fraction=high, low_fraction=low)
    paused = []
    for _ in values:
        monitor.poll_once()
        paused.append(monitor.paused)
    return monitor, paused


def test_scripted_curve_pauses_and_resumes_at_the_watermarks():
    curve = [0.5, 0.85, 0.91, 0.89, 0.85, 0.81, 0.79, 0.95]
    monitor, paused = run_curve(curve)
    # 0.85 before any pause stays normal (inside the band); 0.89..0.81 after the pause stay high;
    # 0.79 is the first reading at or below low; 0.95 pauses again.
    assert paused == [False, False, True, True, True, True, False, True]
    assert monitor.transitions == 3  # up at 0.91, down at 0.79, up at 0.95
    assert monitor.state == "high"
    assert monitor.readings == {"device": 0.95}
    assert monitor.polls == len(curve)


def test_exact_watermarks_are_crossings():
    # ">= high" pauses, "<= low" resumes.
    _, paused = run_curve([0.9, 0.8, 0.9])
    assert paused == [True, False, True]


def test_hovering_at_the_high_watermark_does_not_flap():
    hover = [0.89, 0.91] * 10
    monitor, paused = run_curve(hover + [0.85, 0.81, 0.80])
    assert paused == [False] + [True] * (len(hover) - 1) + [True, True, False]
    assert monitor.transitions == 2  # one pause, one resume


def test_hovering_at_the_low_watermark_does_not_flap():
    hover = [0.81, 0.79] * 10
    monitor, paused = run_curve([0.95] + hover)
    assert paused == [True, True] + [False] * (len(hover) - 1)
    assert monitor.transitions == 2


def test_high_when_any_source_is_high_normal_only_when_every_source_is_low():
    device = ScriptedSource([0.95, 0.50, 0.50, 0.50])
    host = ScriptedSource([0.50, 0.85, 0.79, 0.79])
    monitor = PressureMonitor({"device": device, "host": host}, high_fraction=0.9, low_fraction=0.8)
    assert [monitor.poll_once() for _ in range(4)] == ["high", "high", "normal", "normal"]
    assert monitor.transitions == 2


def test_on_change_sees_every_state_change_and_its_errors_are_logged(caplog):
    changes = []

    def on_change(old, new):
        changes.append((old, new))
        raise RuntimeError("callback bug")

    source = ScriptedSource([0.5, 0.95, None, 0.5])
    monitor = PressureMonitor({"s": source}, on_change=on_change)
    assert monitor.state == "unknown" and not monitor.paused  # nothing measured yet
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(4):
            monitor.poll_once()
    assert changes == [("unknown", "normal"), ("normal", "high"), ("high", "unknown"), ("unknown", "normal")]
    assert monitor.transitions == 2  # paused changed twice: into high and out of it (to unknown)
    assert sum("on_change callback failed" in r.getMessage() for r in caplog.records) == 4


def test_partly_unknown_sources_use_the_known_ones():
    monitor = PressureMonitor({"device": FakeNvml([None, None]), "host": ScriptedSource([0.95, 0.5])})
    assert monitor.poll_once() == "high"
    assert monitor.readings == {"device": None, "host": 0.95}
    assert monitor.poll_once() == "normal"


def test_all_unknown_is_unknown_not_paused_and_said_once(caplog):
    monitor = PressureMonitor({"device": FakeNvml([None]), "latency": ScriptedSource([None])})
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(50):
            assert monitor.poll_once() == "unknown"
    assert not monitor.paused
    assert monitor.transitions == 0
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert messages.count("pressure unknown: NVML unavailable (fake NVML scripted no reading)") == 1
    assert messages.count("pressure unknown: scripted source has no reading") == 1
    assert sum("no source gives a memory-pressure reading" in m for m in messages) == 1
    assert len(messages) == 3


def test_bad_readings_are_unknown_or_clipped(caplog):
    def broken():
        raise OSError("sensor gone")

    monitor = PressureMonitor(
        {
            "broken": broken,
            "nan": lambda: math.nan,
            "text": lambda: "0.5",
            "over": lambda: 1.7,
            "under": lambda: -0.2,
        }
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(5):
            monitor.poll_once()
    assert monitor.readings == {"broken": None, "nan": None, "text": None, "over": 1.0, "under": 0.0}
    assert monitor.state == "high"
    unknown = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pressure unknown")]
    assert unknown == [
        "pressure unknown: source 'broken' raised OSError: sensor gone",
        "pressure unknown: source 'nan' returned nan, not a fraction",
        "pressure unknown: source 'text' returned '0.5', not a fraction",
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"high_fraction": 1.5}, r"high_fraction must be in \(0, 1\], got 1.5"),
        ({"low_fraction": 0}, r"low_fraction must be in \(0, 1\], got 0"),
        ({"high_fraction": 0.8, "low_fraction": 0.8}, r"low_fraction must be < high_fraction .* low=0.8, high=0.8"),
        ({"poll_interval_s": 0}, r"poll_interval_s must be a positive, finite number, got 0"),
        ({"sources": {"x": 0.5}}, r"source 'x' must be callable, got 0.5"),
    ],
)
def test_monitor_rejects_bad_arguments(kwargs, match):
    kwargs.setdefault("sources", {})
    with pytest.raises(ValueError, match=match):
        PressureMonitor(**kwargs)


# -- NVML -----------------------------------------------------------------------------------------


class FakeNvmlError(Exception):
    pass


def fake_nvml_module(init_error=None, used=30, total=100, query_errors=0):
    calls = {"init": 0, "query": 0}

    def nvmlInit():
        calls["init"] += 1
        if init_error is not None:
            raise init_error

    def nvmlDeviceGetMemoryInfo(handle):
        calls["query"] += 1
        if calls["query"] <= query_errors:
            raise FakeNvmlError("GPU is lost")
        return SimpleNamespace(used=used, total=total, free=total - used)

    module = SimpleNamespace(
        NVMLError=FakeNvmlError,
        nvmlInit=nvmlInit,
        nvmlDeviceGetHandleByIndex=lambda index: ("handle", index),
        nvmlDeviceGetMemoryInfo=nvmlDeviceGetMemoryInfo,
    )
    return module, calls


def test_nvml_source_reads_used_over_total_and_inits_once():
    module, calls = fake_nvml_module(used=45, total=60)
    source = nvml_device_memory_source(1, nvml=module)
    assert [source() for _ in range(3)] == [0.75, 0.75, 0.75]
    assert calls == {"init": 1, "query": 3}


def test_nvml_init_failure_is_unknown_for_good_and_logged_once(caplog):
    module, calls = fake_nvml_module(init_error=FakeNvmlError("Driver Not Loaded"))
    source = nvml_device_memory_source(0, nvml=module)
    monitor = PressureMonitor({"device": source, "host": ScriptedSource([0.5])})
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(20):
            assert monitor.poll_once() == "normal"
    assert calls["init"] == 1  # not retried every poll
    assert source.unknown_reason == "NVML unavailable (FakeNvmlError: Driver Not Loaded)"
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["pressure unknown: NVML unavailable (FakeNvmlError: Driver Not Loaded)"]


def test_an_optional_nvml_source_says_so_once_per_process_at_info(caplog):
    # A CPU engine watches no GPU: NVML's absence is expected, said once, not warned per start.
    module, _ = fake_nvml_module(init_error=FakeNvmlError("optional-test: no driver"))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(3):  # three engines started in one process
            monitor = PressureMonitor({"device": nvml_device_memory_source(0, nvml=module, optional=True),
                                       "host": ScriptedSource([0.5])})
            for _ in range(5):
                assert monitor.poll_once() == "normal"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "pressure unknown: NVML unavailable (FakeNvmlError: optional-test: no driver) (expected without a GPU)")
    ]


def test_nvml_query_failure_is_transient():
    module, calls = fake_nvml_module(used=95, total=100, query_errors=1)
    source = nvml_device_memory_source(0, nvml=module)
    assert source() is None
    assert source.unknown_reason == "NVML unavailable (FakeNvmlError: GPU is lost)"
    assert source() == 0.95
    assert source.unknown_reason is None


def test_nvml_on_this_machine_is_either_a_fraction_or_unknown_logged_once(caplog):
    source = nvml_device_memory_source(0)
    monitor = PressureMonitor({"device": source})
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(100):
            monitor.poll_once()
    reading = monitor.readings["device"]
    if reading is not None:  # a machine with a GPU and a driver
        assert 0.0 <= reading <= 1.0 and monitor.state in ("normal", "high")
        return
    assert monitor.state == "unknown" and not monitor.paused
    assert source.unknown_reason.startswith("NVML unavailable (")
    nvml_lines = [r for r in caplog.records if "pressure unknown: NVML unavailable (" in r.getMessage()]
    assert len(nvml_lines) == 1
    assert nvml_lines[0].levelno == logging.WARNING
    assert sum("no source gives a memory-pressure reading" in r.getMessage() for r in caplog.records) == 1


def test_nvml_source_rejects_bad_index():
    with pytest.raises(ValueError, match=r"device_index must be a non-negative int, got -1"):
        nvml_device_memory_source(-1)


def test_host_memory_source_is_a_fraction():
    value = host_memory_source()()
    assert value is not None and 0.0 <= value <= 1.0


def test_default_sources_names():
    ewma = LatencyEwma(0.5, 1.0)
    sources = default_sources(0, {"disk": ewma})
    assert list(sources) == ["device_memory", "host_memory", "disk_write_latency"]
    assert sources["disk_write_latency"] is ewma
    assert list(default_sources(None)) == ["host_memory"]


# -- LatencyEwma ----------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_latency_ewma_averages_and_clips():
    clock = Clock()
    ewma = LatencyEwma(0.5, high_latency_s=2.0, idle_half_life_s=None, clock=clock)
    assert ewma() == 0.0 and ewma.average_s is None  # no write yet, no write pressure
    ewma.observe(1.0)
    assert ewma.average_s == 1.0 and ewma() == 0.5  # the first observation is taken as is
    ewma.observe(3.0)
    assert ewma.average_s == 2.0 and ewma() == 1.0
    ewma.observe(10.0)
    assert ewma.average_s == 6.0 and ewma() == 1.0  # clipped
    assert ewma.count == 3
    assert ewma.fraction() == ewma() == 1.0  # the method and the call are the same reading


def test_latency_ewma_decays_while_idle_so_a_pause_can_end():
    clock = Clock()
    ewma = LatencyEwma(0.2, high_latency_s=1.0, idle_half_life_s=10.0, clock=clock)
    ewma.observe(1.0)
    monitor = PressureMonitor({"disk_write_latency": ewma}, high_fraction=0.9, low_fraction=0.5)
    assert monitor.poll_once() == "high"
    clock.now += 5.0
    assert ewma() == pytest.approx(0.5**0.5)
    assert monitor.poll_once() == "high"
    clock.now += 5.0
    assert ewma() == pytest.approx(0.5)
    assert monitor.poll_once() == "normal"
    # A new observation folds into the decayed average, not the stale one.
    ewma.observe(0.5)
    assert ewma.average_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0.0, 1.0), {}, r"alpha must be in \(0, 1\], got 0.0"),
        ((1.5, 1.0), {}, r"alpha must be in \(0, 1\], got 1.5"),
        ((0.5, 0.0), {}, r"high_latency_s must be a positive, finite number, got 0.0"),
        ((0.5, 1.0), {"idle_half_life_s": 0}, r"idle_half_life_s must be a positive, finite number or None, got 0"),
    ],
)
def test_latency_ewma_rejects_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatencyEwma(*args, **kwargs)


def test_latency_ewma_rejects_bad_observations():
    ewma = LatencyEwma(0.5, 1.0)
    for bad in (-1.0, math.nan, "1"):
        with pytest.raises(ValueError, match="seconds must be a non-negative number"):
            ewma.observe(bad)  # type: ignore[arg-type]
    assert ewma.count == 0


# -- ScriptedSource -------------------------------------------------------------------------------


def test_scripted_source_holds_last_value_and_can_be_rescripted():
    source = ScriptedSource([0.1, 0.2])
    assert [source(), source(), source()] == [0.1, 0.2, 0.2]
    source.extend([0.3, None])
    assert source.remaining == 2
    assert [source(), source()] == [0.3, None]
    assert source.unknown_reason == "scripted source has no reading"
    source.set(0.7)
    assert [source(), source()] == [0.7, 0.7]
    assert source.unknown_reason is None
    assert source.calls == 7
    assert ScriptedSource()() is None


# -- background polling ---------------------------------------------------------------------------


async def wait_until(predicate, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_start_polls_off_the_loop_and_applies_on_the_loop():
    loop_thread = threading.get_ident()
    source_threads = set()
    change_threads = set()
    script = ScriptedSource([0.5, 0.95, 0.85, 0.7])

    def source():
        source_threads.add(threading.get_ident())
        return script()

    monitor = PressureMonitor(
        {"device": source},
        poll_interval_s=0.01,
        on_change=lambda old, new: change_threads.add(threading.get_ident()),
    )
    await monitor.start()
    await monitor.start()  # safe twice
    try:
        await wait_until(lambda: monitor.polls >= 6)
        assert monitor.running
        assert monitor.state == "normal" and monitor.transitions == 2
    finally:
        await monitor.stop()
    assert loop_thread not in source_threads and len(source_threads) == 1
    assert change_threads == {loop_thread}
    assert not monitor.running
    polls = monitor.polls
    await asyncio.sleep(0.05)
    assert monitor.polls == polls  # stopped means stopped
    await monitor.stop()  # safe twice


@pytest.mark.asyncio
async def test_stop_before_start_and_restart():
    monitor = PressureMonitor({"device": FakeNvml([0.95])}, poll_interval_s=0.01)
    await monitor.stop()
    await monitor.start()
    await wait_until(lambda: monitor.paused)
    await monitor.stop()
    await monitor.start()
    polls = monitor.polls
    await wait_until(lambda: monitor.polls > polls)
    await monitor.stop()
    assert monitor.paused and monitor.transitions == 1


@pytest.mark.asyncio
async def test_stop_does_not_wait_for_a_hung_source():
    release = threading.Event()
    calls = []

    def slow():
        calls.append(1)
        release.wait(5.0)
        return 0.5

    monitor = PressureMonitor({"device": slow}, poll_interval_s=0.01)
    await monitor.start()
    await wait_until(lambda: calls)
    await asyncio.wait_for(monitor.stop(), timeout=1.0)
    release.set()
    assert monitor.polls == 0  # the late reading was discarded


# -- device headroom: what offload needs, not NVML's "used" ------------------------------------

GiB, MiB = 1 << 30, 1 << 20


def test_the_gpu_is_found_by_uuid_not_by_torchs_index():
    # CUDA_VISIBLE_DEVICES=1 makes the second GPU torch's cuda:0; NVML's index 0 is still the first.
    nvml = FakeNvmlLibrary(80 * GiB, [10 * GiB], uuids=["GPU-aaaa", "GPU-bbbb"])
    source = nvml_device_headroom_source(128 * MiB, uuid="GPU-bbbb", nvml=nvml)
    assert source() == pytest.approx(128 * MiB / (70 * GiB))
    assert ("by_uuid", "GPU-bbbb") in nvml.calls and not any(name == "by_index" for name, _ in nvml.calls)
    assert nvml.calls[-1] == ("memory", "GPU-bbbb")
    missing = nvml_device_headroom_source(128 * MiB, uuid="GPU-cccc", nvml=nvml)
    assert missing() is None and missing.unknown_reason == "NVML unavailable (FakeNvmlError: Not Found: GPU-cccc)"
    assert nvml_device_memory_source(0, uuid="GPU-bbbb", nvml=nvml)() == pytest.approx(10 / 80)


def test_a_reserved_pool_at_92_percent_is_not_pressure():
    # vLLM reserves 90% of the GPU up front: NVML's used/total sits at 0.92 for good. With ~11 GiB
    # free and 128 MiB of staging needed, offload has all the room it needs.
    total = 141 * GiB
    nvml = FakeNvmlLibrary(total, [int(0.92 * total)])
    monitor = PressureMonitor({"device": nvml_device_headroom_source(128 * MiB, uuid="GPU-fake-0", nvml=nvml)})
    assert [monitor.poll_once() for _ in range(5)] == ["normal"] * 5 and monitor.readings["device"] < 0.02
    # The old reading, used / total, would have paused for good at the default 0.90 mark.
    old = PressureMonitor({"device": nvml_device_memory_source(0, nvml=nvml)})
    assert old.poll_once() == "high"


def test_an_allocation_leaving_no_room_for_staging_backs_off_with_hysteresis():
    total, need = 80 * GiB, 128 * MiB
    free_curve = [8 * GiB, 1 * GiB, 200 * MiB, 140 * MiB, 100 * MiB, 150 * MiB, 165 * MiB, 170 * MiB, 2 * GiB]
    nvml = FakeNvmlLibrary(total, [total - free for free in free_curve])
    reusable = [0]
    monitor = PressureMonitor({"device": nvml_device_headroom_source(need, uuid="GPU-fake-0", nvml=nvml,
                                                                      reusable_bytes=lambda: reusable[0])})
    states = [monitor.poll_once() for _ in free_curve]
    # Pause once free room is under need / 0.90 (~142 MiB), resume only at need / 0.80 (160 MiB).
    assert states == ["normal", "normal", "normal", "high", "high", "high", "normal", "normal", "normal"]
    assert monitor.transitions == 2
    nvml.set_used(total - 100 * MiB)
    assert monitor.poll_once() == "high"
    reusable[0] = 1 * GiB  # torch's caching allocator holds a free GiB in this process: room enough
    assert monitor.poll_once() == "normal"
