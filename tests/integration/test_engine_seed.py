"""The seed scenario through the engine: exact stored and loaded (group, block) sets, bitwise bytes,
and the same consumer served from disk alone after a restart."""

from __future__ import annotations

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device


def seed_layout(extra: int) -> ModelLayout:
    return ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8, extra_retained_tokens=extra)))


def expected_sets(extra: int):
    stored_swa = {2, 3, 6, 7} | ({1, 5} if extra == 3 else set())
    loaded_swa = {6, 7} | ({5} if extra == 3 else set())
    return {0: {0, 1}, 1: stored_swa}, {0: {0, 1}, 1: loaded_swa}


@pytest.mark.asyncio
@pytest.mark.parametrize("extra", [0, 1, 3])
async def test_seed_scenario_stores_and_loads_exact_sets(extra, kvtier_engine_factory):
    layout = seed_layout(extra)
    engine = await kvtier_engine_factory(layout=layout)
    scenario = OffloadScenario(engine, seed=extra)
    prompt = scenario.tokens(33)
    expect_stored, expect_loaded = expected_sets(extra)

    producer = await scenario.produce(prompt, expect_stored=expect_stored)
    assert producer.durable is True
    assert producer.skipped == {0: set(), 1: set()}

    consumer = await scenario.consume(prompt + [7], expect_hit=32, expect_loaded=expect_loaded)
    assert consumer.ok

    # Storing the same prompt again stores nothing twice.
    again = await scenario.produce(prompt, expect_stored={})
    assert again.skipped == expect_stored
    engine.check()


@pytest.mark.asyncio
@pytest.mark.parametrize("extra", [0, 3])
async def test_seed_consumer_served_from_disk_after_restart(extra, tmp_path):
    layout = seed_layout(extra)
    config = EngineConfig(cache_dir=str(tmp_path / "cache"), host_capacity_bytes=1 << 20)
    device = make_cpu_device(layout)
    expect_stored, expect_loaded = expected_sets(extra)
    async with OffloadEngine(layout, device, config, fingerprint=b"seed") as producer_engine:
        producer_scenario = OffloadScenario(producer_engine, seed=11)
        prompt = producer_scenario.tokens(33)
        await producer_scenario.produce(prompt, expect_stored=expect_stored)

    async with OffloadEngine(layout, device, config, fingerprint=b"seed") as engine:
        assert engine.statistics()["chunks_by_state"] == {"pending": 0, "ready": 0, "loading": 0}
        scenario = OffloadScenario(engine, seed=12)
        scenario.producer_bytes = producer_scenario.producer_bytes  # what the producer stored, by key
        consumer = await scenario.consume(prompt + [1], expect_hit=32, expect_loaded=expect_loaded)
        assert consumer.ok
        stats = engine.statistics()
        assert stats["loaded_chunks"]["disk"] == sum(len(v) for v in expect_loaded.values())
        engine.check()


@pytest.mark.asyncio
async def test_other_fingerprint_or_salt_never_hits(tmp_path, kvtier_engine_factory):
    layout = seed_layout(0)
    engine = await kvtier_engine_factory(layout=layout)
    scenario = OffloadScenario(engine)
    prompt = scenario.tokens(33)
    await scenario.produce(prompt, salt=b"tenant-a")
    assert engine.lookup(prompt + [1], salt=b"tenant-a") == 32
    assert engine.lookup(prompt + [1], salt=b"tenant-b") == 0
    assert engine.lookup(prompt + [1]) == 0
    # Another model (fingerprint) on its own directory: same tokens, same salt, no hit.
    other_config = EngineConfig(cache_dir=str(tmp_path / "other"), host_capacity_bytes=1 << 20)
    other = await kvtier_engine_factory(layout=layout, fingerprint=b"another-model", config=other_config)
    assert other.request_keys(prompt, salt=b"tenant-a").keys != engine.request_keys(prompt, salt=b"tenant-a").keys
    assert other.lookup(prompt + [1], salt=b"tenant-a") == 0
