"""Disk-write admission in a real engine over a real LMDB tier (``disk_admission``): under ``seen``
a chunk stored for the first time stays on the host only, one stored again after the host let
it go is written to disk, and a host-only chunk a load hits is written to disk then; ``all``
writes every chunk through, and so does ``seen`` over an unbounded disk, one more than
``MAX_DISK_TO_HOST`` times the host (in chunks), or one with a remote tier behind it."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tools.testing.pressure import ScriptedSource
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

FULL = ModelLayout(groups=(AttentionGroup(16),))
CHUNK = 16  # tokens per chunk of FULL


async def _engine(tmp_path, **overrides) -> OffloadEngine:
    # Four host slots of 2 KiB chunks over a disk of four chunks' bytes: within MAX_DISK_TO_HOST.
    values = dict(cache_dir=str(tmp_path / "cache"), host_capacity_bytes=1, disk_capacity_bytes=4 * 2048,
                  lmdb_map_size_bytes=256 << 20, pressure_poll_interval_s=3600.0, tier_timeout_s=5.0,
                  host_eviction_policy="lru", disk_admission="seen")
    values.update(overrides)
    engine = OffloadEngine(FULL, make_cpu_device(FULL, num_blocks=128), EngineConfig(**values),
                           fingerprint=b"admission", pressure_sources={"host_memory": ScriptedSource([0.0])})
    await engine.start()
    return engine


def _on_disk(engine: OffloadEngine, keys) -> set:
    return {c for c, key in enumerate(keys.keys[0]) if key in engine.disk_index}


async def _close(engine: OffloadEngine) -> None:
    await asyncio.wait_for(engine.flush(), 10)
    engine.check()
    await asyncio.wait_for(engine.close(), 10)


@pytest.mark.asyncio
async def test_seen_keeps_a_first_store_on_the_host_and_writes_it_when_it_comes_back(tmp_path):
    engine = await _engine(tmp_path)
    scenario = OffloadScenario(engine)
    assert engine.host.pools[0].num_slots == 4
    prompt = scenario.tokens(2 * CHUNK + 1)
    keys = engine.request_keys(prompt)
    first = await scenario.produce(prompt, expect_stored={0: range(2)})
    await engine.flush()
    assert not first.durable and _on_disk(engine, keys) == set()
    # Two other prompts of two chunks each push the first one out of the four host slots.
    for _ in range(2):
        await scenario.produce(scenario.tokens(2 * CHUNK + 1), expect_stored={0: range(2)})
    await engine.flush()
    assert engine.lookup(keys) == 0
    again = await scenario.produce(prompt, expect_stored={0: range(2)})
    await engine.flush()
    assert again.durable and _on_disk(engine, keys) == {0, 1}
    await _close(engine)


@pytest.mark.asyncio
async def test_seen_writes_a_host_only_chunk_to_disk_when_a_load_hits_it(tmp_path):
    engine = await _engine(tmp_path)
    scenario = OffloadScenario(engine)
    prompt = scenario.tokens(3 * CHUNK + 1)
    keys = engine.request_keys(prompt)
    await scenario.produce(prompt, expect_stored={0: range(3)})
    await engine.flush()
    assert _on_disk(engine, keys) == set()
    # The hit covers chunks 0 and 1 only (48 tokens asked, the last one is never a hit).
    await scenario.consume(prompt[: 2 * CHUNK + 1], expect_hit=2 * CHUNK, expect_loaded={0: range(2)})
    await engine.flush()
    assert _on_disk(engine, keys) == {0, 1}
    # On disk now, they survive the host evicting them, and load back bit for bit from there.
    for _ in range(2):
        await scenario.produce(scenario.tokens(2 * CHUNK + 1), expect_stored={0: range(2)})
    await engine.flush()
    assert not {keys.keys[0][0], keys.keys[0][1]} & set(engine.host.entries)
    await scenario.consume(prompt, expect_hit=2 * CHUNK, expect_loaded={0: range(2)})
    await _close(engine)


@pytest.mark.parametrize("overrides", [dict(disk_admission="all"), dict(disk_capacity_bytes=None),
                                       dict(disk_capacity_bytes=64 << 20)])
@pytest.mark.asyncio
async def test_all_and_a_disk_much_larger_than_the_host_write_every_chunk_through(tmp_path, overrides):
    engine = await _engine(tmp_path, **overrides)
    scenario = OffloadScenario(engine)
    prompt = scenario.tokens(2 * CHUNK + 1)
    keys = engine.request_keys(prompt)
    stored = await scenario.produce(prompt, expect_stored={0: range(2)})
    assert stored.durable and _on_disk(engine, keys) == {0, 1}
    await _close(engine)


def test_an_unknown_admission_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match=r"disk_admission must be one of 'all', 'seen', got 'lfu'"):
        EngineConfig(disk_admission="lfu")


@pytest.mark.asyncio
async def test_seen_under_a_remote_tier_writes_every_chunk_for_the_fleet_to_share(tmp_path, valkey_node):
    from kvtier.tiers.remote import RemoteTier

    namespace = f"admission-{tmp_path.name}"
    engine = await _engine(tmp_path, remote_url=valkey_node.url, remote_namespace=namespace)
    scenario = OffloadScenario(engine)
    prompt = scenario.tokens(2 * CHUNK + 1)
    keys = engine.request_keys(prompt)
    stored = await scenario.produce(prompt, expect_stored={0: range(2)})
    await engine.flush()
    assert stored.durable and _on_disk(engine, keys) == {0, 1}
    other_host = await RemoteTier.open(valkey_node.url, namespace=namespace, fingerprint=b"admission")
    try:
        assert await other_host.contains_many(list(keys.keys[0][:2])) == [True, True]
    finally:
        await other_host.close()
    await _close(engine)
