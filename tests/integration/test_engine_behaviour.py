"""Engine behaviour beyond the seed: shrinking and pending hits, cancellation, shutdown, single
flight, timeouts, bounded queues, host exhaustion, pressure back-off, prefetch, fences, events."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Tuple

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.tools.testing.pressure import FakeNvml, ScriptedSource
from kvtier.errors import ClosedError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tools.testing.faults import FaultyTier
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))  # R = 0
STORED = {0: {0, 1}, 1: {2, 3, 6, 7}}
LOADED_AT_32 = {0: {0, 1}, 1: {6, 7}}
FINGERPRINT = b"behaviour"


def config(tmp_path, **overrides) -> EngineConfig:
    values = dict(
        cache_dir=str(tmp_path / "cache"),
        host_capacity_bytes=1 << 20,
        lmdb_map_size_bytes=32 << 20,
        pressure_poll_interval_s=3600.0,
        tier_timeout_s=5.0,
    )
    values.update(overrides)
    return EngineConfig(**values)


class GateDevice:
    """Holds the engine's device -> host copies until ``open()``: keeps stores PENDING."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        real = engine.device.gather_many_groups

        def gated(*args, **kwargs):
            self.entered.set()
            self.gate.wait(10)
            return real(*args, **kwargs)

        engine.device.gather_many_groups = gated

    def open(self) -> None:
        self.gate.set()


async def gated_engine(kvtier_engine_factory, **kwargs) -> Tuple[OffloadEngine, OffloadScenario, GateDevice]:
    """A started engine of ``LAYOUT`` (``kwargs`` to the factory), its scenario, and a gate holding
    its device copies."""
    engine = await kvtier_engine_factory(layout=LAYOUT, **kwargs)
    return engine, OffloadScenario(engine), GateDevice(engine)


async def stored_on_disk(tmp_path, seed: int = 0, num_blocks: int = 256):
    """Store the 33-token seed prompt durably, close; returns (prompt, producer's bytes, device)."""
    device = make_cpu_device(LAYOUT, num_blocks=num_blocks)
    async with OffloadEngine(LAYOUT, device, config(tmp_path), fingerprint=FINGERPRINT) as engine:
        scenario = OffloadScenario(engine, seed=seed)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt, expect_stored=STORED)
    return prompt, scenario.producer_bytes, device


async def engine_over(tmp_path, device, *, disk_faults=None, **overrides) -> OffloadEngine:
    disk = None
    if disk_faults is not None:
        disk = FaultyTier(await LmdbTier.open(tmp_path / "cache"), **disk_faults)
    engine = OffloadEngine(LAYOUT, device, config(tmp_path, **overrides), fingerprint=FINGERPRINT, disk_tier=disk)
    await engine.start()
    return engine


async def restarted_consumer(tmp_path, *, num_blocks: int = 256, disk_faults=None, **overrides):
    """Store the seed prompt durably, then restart an engine over the same directory (optionally
    behind a FaultyTier). Returns (prompt, engine, scenario checking against the producer's bytes)."""
    prompt, producer_bytes, device = await stored_on_disk(tmp_path, num_blocks=num_blocks)
    engine = await engine_over(tmp_path, device, disk_faults=disk_faults, **overrides)
    scenario = OffloadScenario(engine)
    scenario.producer_bytes = producer_bytes
    return prompt, engine, scenario


async def close_checked(engine: OffloadEngine) -> None:
    await engine.flush()
    engine.check()
    await engine.close()
    if isinstance(engine.disk_tier, FaultyTier):
        await engine.disk_tier.close()


@pytest.mark.asyncio
async def test_a_missing_chunk_shrinks_the_hit(kvtier_engine_factory):
    engine = await kvtier_engine_factory(layout=LAYOUT)
    scenario = OffloadScenario(engine)
    prompt = scenario.tokens(33)
    await scenario.produce(prompt, expect_stored=STORED)
    # Shares 20 tokens: FA chunk 1 and SWA chunks >= 5 have other keys. H = 16 needs FA {0}, SWA {2, 3}.
    diverging = prompt[:20] + [t + 1 for t in prompt[20:]]
    await scenario.consume(diverging + [5], expect_hit=16, expect_loaded={0: {0}, 1: {2, 3}})
    # Shares 10 tokens: no FA chunk matches, so nothing.
    await scenario.consume(prompt[:10] + [9] * 24, expect_hit=0)


@pytest.mark.asyncio
async def test_pending_chunks_give_none_then_the_full_hit(kvtier_engine_factory):
    engine, scenario, gate = await gated_engine(kvtier_engine_factory)
    prompt = scenario.tokens(33)
    produce = asyncio.ensure_future(scenario.produce(prompt, expect_stored=STORED))
    await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, 5)
    assert engine.lookup(prompt + [1]) is None  # chunks PENDING: ask again next step
    assert engine.statistics()["chunks_by_state"]["pending"] == 6
    gate.open()
    await produce
    assert engine.lookup(prompt + [1]) == 32


@pytest.mark.asyncio
async def test_loading_chunks_give_none_then_the_full_hit(tmp_path):
    prompt, engine, scenario = await restarted_consumer(tmp_path, disk_faults={"delay_s": 0.3})
    assert engine.lookup(prompt + [1]) == 32
    load = asyncio.ensure_future(scenario.consume(prompt + [1], expect_hit=32, expect_loaded=LOADED_AT_32))
    await asyncio.sleep(0.05)
    assert engine.lookup(prompt + [1]) is None  # disk -> host reads in flight
    await load
    assert engine.lookup(prompt + [1]) == 32
    await close_checked(engine)


@pytest.mark.asyncio
@pytest.mark.parametrize("cancel_after_s", [0.0, 0.005, 0.02, 0.05, 0.09, 0.15])
async def test_cancelling_a_load_at_any_point_leaks_nothing(tmp_path, cancel_after_s):
    prompt, engine, scenario = await restarted_consumer(tmp_path, disk_faults={"delay_s": 0.06})
    table = scenario.allocate(34)
    task = asyncio.ensure_future(engine.load(prompt + [1], 32, table))
    for _ in range(3):
        await asyncio.sleep(0)
    await asyncio.sleep(cancel_after_s)
    task.cancel()
    results = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError) or results[0].ok
    await engine.flush()
    engine.check()  # nothing LOADING or pinned, every slot accounted for
    await engine.fence(table[1], group_index=1)
    # The engine still serves the same hit, bitwise.
    await scenario.consume(prompt + [1], expect_hit=32, expect_loaded=LOADED_AT_32)
    await close_checked(engine)


@pytest.mark.asyncio
@pytest.mark.parametrize("ticks", [0, 1, 2, 3, 5, 8])
async def test_cancelling_store_waits_never_breaks_the_store(kvtier_engine_factory, ticks):
    engine = await kvtier_engine_factory(layout=LAYOUT)
    scenario = OffloadScenario(engine)
    prompt = scenario.tokens(33)
    table = scenario.allocate(33)
    handle = engine.store(prompt, table)
    waiter = asyncio.ensure_future(handle.wait_durable())
    for _ in range(ticks):
        await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    result = await handle  # the store itself carried on
    assert result.durable is True
    assert {(g, c) for g, c in result.scheduled} == {(0, 0), (0, 1), (1, 2), (1, 3), (1, 6), (1, 7)}
    assert engine.lookup(prompt + [1]) == 32


@pytest.mark.asyncio
async def test_close_during_a_load_raises_closed_and_leaks_nothing(tmp_path):
    prompt, engine, scenario = await restarted_consumer(tmp_path, disk_faults={"delay_s": 0.2})
    task = asyncio.ensure_future(engine.load(prompt + [1], 32, scenario.allocate(34)))
    await asyncio.sleep(0.05)
    await engine.close()
    with pytest.raises(ClosedError, match="closed during the load"):
        await task
    engine.check()
    for pool in engine.host.pools:
        assert pool.statistics()["pinned_slots"] == 0
    with pytest.raises(ClosedError, match="closed"):
        engine.lookup(prompt)
    await engine.close()  # safe twice
    await engine.disk_tier.close()


@pytest.mark.asyncio
async def test_two_hundred_concurrent_loads_of_one_chunk_read_the_tier_once(tmp_path):
    prompt, engine, scenario = await restarted_consumer(tmp_path, num_blocks=2400, disk_faults={"delay_s": 0.05})
    results = await asyncio.gather(
        *(scenario.consume(prompt + [i], expect_hit=32, expect_loaded=LOADED_AT_32) for i in range(200))
    )
    assert all(r.ok for r in results)
    assert engine.disk_tier.calls_by_op["get_many_into"] == 1
    assert engine.statistics()["loaded_chunks"]["disk"] == 4
    await close_checked(engine)


@pytest.mark.asyncio
async def test_a_slow_tier_past_its_timeout_is_a_miss_and_rolls_back(tmp_path):
    prompt, engine, scenario = await restarted_consumer(tmp_path, disk_faults={"delay_s": 0.4}, tier_timeout_s=0.05)
    result = await engine.load(prompt + [1], 32, scenario.allocate(34))
    assert (result.ok, result.reason, result.loaded) == (False, "timeout", ())
    assert engine.statistics()["misses"]["timeout"] == 1
    # Nothing stays LOADING: the abandoned chunks are back to disk-only, their slots freed once the
    # late read reported (and its result was discarded).
    await engine.flush()
    engine.check()
    assert engine.statistics()["chunks_by_state"] == {"pending": 0, "ready": 0, "loading": 0}
    engine.disk_tier.heal()
    # The same engine loads them again, with a timeout a healthy disk meets on a loaded machine
    # (50 ms was only there to be missed by the slow tier).
    engine.config = dataclasses.replace(engine.config, tier_timeout_s=5.0)
    await scenario.consume(prompt + [1], expect_hit=32, expect_loaded=LOADED_AT_32)
    await close_checked(engine)


@pytest.mark.asyncio
async def test_a_full_store_queue_drops_and_counts(kvtier_engine_factory, tmp_path):
    engine = await kvtier_engine_factory(layout=LAYOUT, config=config(tmp_path, store_queue_max_chunks=5))
    scenario = OffloadScenario(engine)
    record = await scenario.produce(scenario.tokens(33), expect_stored={})
    assert record.dropped == STORED
    assert engine.statistics()["dropped"]["queue_full"] == 6


@pytest.mark.asyncio
async def test_an_exhausted_host_pool_says_cannot_fast_and_recovers(tmp_path, kvtier_engine_factory):
    # No disk tier; 4 slots per group (the floor). Held PENDING copies pin every slot.
    engine, scenario, gate = await gated_engine(kvtier_engine_factory, config=config(tmp_path, cache_dir=None, host_capacity_bytes=1))
    first = scenario.tokens(16)  # FA chunk 0; SWA blocks 2, 3
    first_table = scenario.allocate(16)
    handle = engine.store(first, first_table)
    second = scenario.tokens(33)
    second_table = scenario.allocate(33)
    blocked = engine.store(second, second_table)  # FA 2 + SWA 4 slots: SWA has 2 left -> cannot
    assert blocked.drop_reason == "host_full"
    assert set(blocked.dropped) == {(0, 0), (0, 1), (1, 2), (1, 3), (1, 6), (1, 7)}
    assert blocked.released
    gate.open()
    await handle.wait_released()
    # READY chunks without a disk tier are evictable: the same store now fits by evicting them.
    retried = engine.store(second, second_table)
    assert retried.drop_reason is None
    await retried.wait_released()
    assert engine.lookup(second + [1]) == 32
    assert engine.lookup(first + [1]) == 0
    assert engine.statistics()["dropped"]["host_full"] == 6


@pytest.mark.asyncio
async def test_scripted_pressure_pauses_and_resumes_stores_without_flapping(tmp_path, kvtier_engine_factory):
    nvml = FakeNvml([0.5])
    engine = await kvtier_engine_factory(
        layout=LAYOUT, config=config(tmp_path), pressure_sources={"device_memory": nvml}
    )
    scenario = OffloadScenario(engine)
    states = []
    for fraction in [0.5, 0.95, 0.89, 0.91, 0.85, 0.81, 0.79, 0.85, 0.89]:
        nvml.set(fraction)
        engine.pressure.poll_once()
        states.append(engine.pressure.paused)
        record = await scenario.produce(scenario.tokens(33))
        if engine.pressure.paused:
            assert record.stored == {0: set(), 1: set()} and record.dropped == STORED
        else:
            assert record.stored == STORED
        # Prefetch and promotions pause too.
        if engine.pressure.paused:
            assert await engine.prefetch(scenario.tokens(33)) == 0
    assert states == [False, True, True, True, True, True, False, False, False]
    assert engine.pressure.transitions == 2
    assert engine.statistics()["dropped"]["pressure"] == 6 * 5


@pytest.mark.asyncio
async def test_without_nvml_the_engine_runs_and_says_unknown_once(tmp_path, caplog, monkeypatch):
    import kvtier.engine.pressure as pressure

    if pressure.nvml_device_memory_source(0)() is not None:
        pytest.skip("NVML answers on this machine")
    monkeypatch.setattr(pressure, "_OPTIONAL_UNKNOWN_LOGGED", set())  # as in a fresh process
    caplog.set_level(logging.INFO)
    layout = LAYOUT
    for run in range(2):  # a second engine in the same process says nothing more
        (tmp_path / str(run)).mkdir()
        async with OffloadEngine(layout, make_cpu_device(layout), config(tmp_path / str(run), pressure_poll_interval_s=0.01),
                                 fingerprint=FINGERPRINT) as engine:
            scenario = OffloadScenario(engine)
            for _ in range(3):
                await scenario.produce(scenario.tokens(33), expect_stored=STORED)
                await asyncio.sleep(0.03)
    unknown = [r for r in caplog.records if "NVML" in r.getMessage() and "unknown" in r.getMessage()]
    assert [r.levelno for r in unknown] == [logging.INFO], [r.getMessage() for r in caplog.records]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
async def test_prefetch_promotes_disk_chunks_to_host(tmp_path, policy):
    prompt, engine, scenario = await restarted_consumer(tmp_path)
    count = await engine.prefetch(prompt + [1], policy=policy, timeout_s=5.0 if policy == "timeout" else None)
    assert count == 4  # FA {0, 1}, SWA {6, 7}
    await engine.flush()
    assert engine.statistics()["chunks_by_state"]["ready"] == 4
    await scenario.consume(prompt + [1], expect_hit=32, expect_loaded=LOADED_AT_32)
    assert engine.statistics()["loaded_chunks"]["disk"] == 4  # read once, by the prefetch
    with pytest.raises(ValueError, match="policy must be one of"):
        await engine.prefetch(prompt, policy="eventually")
    await close_checked(engine)


@pytest.mark.asyncio
async def test_fence_waits_for_the_copy_reading_a_block(kvtier_engine_factory):
    engine, scenario, gate = await gated_engine(kvtier_engine_factory)
    prompt = scenario.tokens(33)
    table = scenario.allocate(33)
    handle = engine.store(prompt, table)
    fence = asyncio.ensure_future(engine.fence([table[1][6]], group_index=1))
    await asyncio.sleep(0.05)
    assert not fence.done()
    gate.open()
    await fence
    assert handle.released
    await engine.fence([table[1][0]], group_index=1)  # block 0 was never stored: no wait


@pytest.mark.asyncio
async def test_events_report_where_chunks_live(kvtier_engine_factory):
    engine = await kvtier_engine_factory(layout=LAYOUT)
    scenario = OffloadScenario(engine)
    prompt = scenario.tokens(33)
    await scenario.produce(prompt)
    events = engine.take_events()
    keys = engine.request_keys(prompt)
    stored = {(e.group_index, keys.keys[e.group_index].index(e.key), e.tier) for e in events if e.kind == "stored"}
    want = {(g, c, tier) for g, blocks in STORED.items() for c in blocks for tier in ("host", "disk")}
    assert stored == want
    assert engine.take_events() == []


@pytest.mark.asyncio
async def test_bad_arguments_raise_clear_errors(kvtier_engine_factory):
    engine = await kvtier_engine_factory(layout=LAYOUT)
    with pytest.raises(ValueError, match="one list per group"):
        engine.store(list(range(33)), [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"block_table\[1\] has 2 blocks"):
        engine.store(list(range(33)), [[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match="num_tokens must be in"):
        engine.store(list(range(33)), [[1, 2, 3], list(range(9))], 40)
    with pytest.raises(ValueError, match="hit_tokens must be in"):
        await engine.load(list(range(33)), 64, [[1, 2, 3], list(range(9))])
    with pytest.raises(ValueError, match="no device block for logical block 7"):
        await engine.load(list(range(33)), 32, [[1, 2], [1] * 7])


@pytest.mark.asyncio
async def test_close_during_a_store_rolls_it_back(tmp_path):
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(tmp_path), fingerprint=FINGERPRINT)
    await engine.start()
    scenario = OffloadScenario(engine)
    gate = GateDevice(engine)
    prompt = scenario.tokens(33)
    handle = engine.store(prompt, scenario.allocate(33))
    closing = asyncio.ensure_future(engine.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # the copy into the slots cannot be interrupted: close waits for it
    gate.open()
    await closing
    result = await handle
    assert result.durable is False
    assert handle.released
    assert engine.statistics()["chunks_by_state"] == {"pending": 0, "ready": 0, "loading": 0}
    assert engine.statistics()["dropped"]["closed"] == 6
    engine.check()
    with pytest.raises(ClosedError):
        engine.store(prompt, scenario.allocate(33))


@pytest.mark.asyncio
async def test_out_of_range_device_blocks_are_a_typed_error_before_anything_runs(kvtier_engine_factory):
    from kvtier.errors import DeviceError

    engine = await kvtier_engine_factory(layout=LAYOUT)
    with pytest.raises(DeviceError, match="group 1: device block 999 is out of range"):
        engine.store(list(range(33)), [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 999, 8]])
    assert engine.statistics()["chunks_by_state"] == {"pending": 0, "ready": 0, "loading": 0}
    with pytest.raises(DeviceError, match="group 0: device block 4096 is out of range"):
        await engine.load(list(range(33)), 32, [[1, 4096, 3], list(range(1, 10))])
