"""The engine on the CUDA code path, run on CPU (``RecordingBackend``): when and on which stream a
store's and a load's order is taken, what a copy failing partway leaves, which device kind the
host pool gets."""

from __future__ import annotations

import threading

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.engine.pressure import nvml_device_headroom_source
from kvtier.errors import DeviceError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tools.testing.device import RecordingBackend, TokenEvent
from kvtier.tools.testing.pressure import FakeNvmlLibrary
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
STORED = {0: {0, 1}, 1: {2, 3, 6, 7}}


def config(**overrides) -> EngineConfig:
    return EngineConfig(host_capacity_bytes=1 << 20, pressure_poll_interval_s=3600.0, **overrides)


@pytest.mark.asyncio
async def test_store_and_load_take_their_order_when_called_on_the_callers_stream():
    backend = RecordingBackend()
    device = make_cpu_device(LAYOUT, backend=backend)
    async with OffloadEngine(LAYOUT, device, config(), fingerprint=b"order") as engine:
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        keys = engine.request_keys(prompt)
        table = scenario.allocate(len(prompt))
        scenario.fill_blocks(keys, table)
        backend.log.clear()
        handle = engine.store(keys, table, compute_stream="forward")
        # Taken inside store(), on the caller's thread, before any copy: a server whose forward
        # pass runs on another stream gets its copy ordered after that pass, not after whatever
        # the copy thread's stream holds later. (The copy itself is handed to the copy thread
        # inside store() too, so its operations may already follow.)
        assert backend.log[0] == ("record", "forward", 1, threading.current_thread().name)
        await handle.wait_released()
        assert backend.log[1][:3] == ("wait", "copy1", 1) and backend.log[1][3].startswith("kvtier-d2h")
        # Per group its 2 KV tensors kept for the copy stream, then one host copy for the group's
        # chunks (2 and 4), whose host slots are consecutive.
        assert [op for op, *_ in backend.log[2:]] == ["keep"] * 2 + ["copy"] + ["keep"] * 2 + ["copy"] + [
            "record", "sync"]
        backend.log.clear()
        result = await engine.load(prompt + [5], 32, scenario.allocate(33))
        assert result.ok
        assert backend.ops()[:2] == [("record", "default", 3), ("wait", "copy2", 3)]  # default: this thread's
        backend.log.clear()
        mine = TokenEvent(77, "server")
        handle = engine.store(prompt + [9] * 31, scenario.allocate(64), ready_event=mine)
        await handle.wait_released()
        assert backend.ops("record", "wait")[0] == ("wait", "copy1", 77)  # the caller's event as is


@pytest.mark.asyncio
async def test_a_copy_failing_partway_frees_slots_and_blocks_only_after_the_queued_copies():
    seen = []
    engine_ref = []

    def at_sync():
        engine = engine_ref[0]
        seen.append(([pool.num_free for pool in engine.host.pools], engine._stores.inflight))

    backend = RecordingBackend(fail_on_copy=2, on_sync=at_sync)  # group 1's, after group 0's was queued
    device = make_cpu_device(LAYOUT, backend=backend)
    async with OffloadEngine(LAYOUT, device, config(), fingerprint=b"fail") as engine:
        engine_ref.append(engine)
        free_before = [pool.num_free for pool in engine.host.pools]
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        record = await scenario.produce(prompt, wait_durable=False)
        # While the failed batch waited for copy 1, its six slots were still taken and its
        # chunks still in flight (their blocks fenced); only then did the engine let go.
        assert seen == [([free_before[0] - 2, free_before[1] - 4], 6)]
        assert [pool.num_free for pool in engine.host.pools] == free_before
        assert engine._stores.inflight == 0 and record.stored == STORED  # scheduled, then dropped
        assert engine.lookup(prompt + [5]) == 0


@pytest.mark.asyncio
async def test_the_host_pool_follows_the_views_device():
    device = make_cpu_device(LAYOUT)
    async with OffloadEngine(LAYOUT, device, config(), fingerprint=b"kind") as engine:
        assert [pool.device_kind for pool in engine.host.pools] == ["cpu", "cpu"]
        assert not any(pool.pinned for pool in engine.host.pools)
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(device_kind="cuda"), fingerprint=b"kind")
    with pytest.raises(DeviceError, match=r"config.device_kind is 'cuda' but the KV tensors are on cpu; leave device_kind unset"):
        await engine.start()
    await engine.close()


@pytest.mark.asyncio
async def test_stores_go_on_at_a_reserved_92_percent_and_back_off_when_staging_has_no_room():
    total = 80 << 30
    nvml = FakeNvmlLibrary(total, [int(0.92 * total)])
    source = nvml_device_headroom_source(128 << 20, uuid="GPU-fake-0", nvml=nvml)
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(), fingerprint=b"room",
                             pressure_sources={"device_memory": source}) as engine:
        scenario = OffloadScenario(engine)
        for _ in range(3):
            engine.pressure.poll_once()
            record = await scenario.produce(scenario.tokens(33), wait_durable=False)
            assert record.stored == STORED and not engine.pressure.paused
        nvml.set_used(total - (100 << 20))  # a growing allocation leaves 100 MiB
        engine.pressure.poll_once()
        record = await scenario.produce(scenario.tokens(33), wait_durable=False)
        assert record.dropped == STORED and engine.statistics()["dropped"]["pressure"] == 6
