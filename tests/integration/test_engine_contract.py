"""The engine keeps its promises on every path: one plain regression test per bug found from the
outside, and one per suspicion, settled.

Each test drives a real engine over a real LMDB tier (or FileTier), with a ``SeamTier`` in front of
it where a test needs a tier call to fail with a foreign exception, to be held, or to stall.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import List, Tuple

import pytest
import torch

from kvtier.engine import EngineConfig, OffloadEngine, StoreHandle
from kvtier.errors import ClosedError, KvtierError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.files import FileTier
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tools.testing.pressure import ScriptedSource
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device
from kvtier.tools.testing.tier_seam import Gate, SeamTier

FULL = ModelLayout(groups=(AttentionGroup(16),))
HYBRID = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
FINGERPRINT = b"contract"


def config(tmp_path, **overrides) -> EngineConfig:
    values = dict(
        cache_dir=None,
        host_capacity_bytes=1 << 20,
        pressure_poll_interval_s=3600.0,
        tier_timeout_s=5.0,
    )
    values.update(overrides)
    return EngineConfig(**values)


class Rig:
    """An engine over SeamTier(LmdbTier) with a scenario; ``close()`` self-checks and closes all."""

    def __init__(self, engine: OffloadEngine, seam: SeamTier, scenario: OffloadScenario) -> None:
        self.engine, self.seam, self.scenario = engine, seam, scenario

    async def close(self, check: bool = True) -> None:
        self.seam.heal()
        if check and not self.engine.closed:
            await asyncio.wait_for(self.engine.flush(), 10)
            self.engine.check()
        await asyncio.wait_for(self.engine.close(), 10)
        await self.seam.inner.close()


async def rig(tmp_path, layout=FULL, *, inner=None, num_blocks=128, sources=None, **overrides) -> Rig:
    if inner is None:
        inner = await LmdbTier.open(tmp_path / "lmdb", map_size_bytes=64 << 20)
    seam = SeamTier(inner)
    engine = OffloadEngine(
        layout,
        make_cpu_device(layout, num_blocks=num_blocks),
        config(tmp_path, **overrides),
        fingerprint=FINGERPRINT,
        disk_tier=seam,
        pressure_sources=sources if sources is not None else {"host_memory": ScriptedSource([0.0])},
    )
    await engine.start()
    return Rig(engine, seam, OffloadScenario(engine))


class GatedCopies:
    """Holds the engine's device copies (one direction) on their copy thread until ``open()``."""

    def __init__(self, engine: OffloadEngine, method: str = "gather_many_groups") -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.finished = threading.Event()
        real = getattr(engine.device, method)

        def gated(*args, **kwargs):
            self.entered.set()
            self.gate.wait(10)
            try:
                return real(*args, **kwargs)
            finally:
                self.finished.set()

        setattr(engine.device, method, gated)

    async def wait_entered(self) -> None:
        assert await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, 5)

    def open(self) -> None:
        self.gate.set()


async def cancel_soon(coro, *, ticks: int = 3):
    """Start ``coro``, let it reach its first waits, cancel it; returns the cancelled task."""
    task = asyncio.ensure_future(coro)
    for _ in range(ticks):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return task


async def _store_held_in_its_copy(r: Rig) -> Tuple[GatedCopies, List[int], List[List[int]], StoreHandle]:
    """A 33-token store whose device -> host copy is held on the copy thread: (gate, prompt, table,
    handle), once the copy has begun."""
    gate = GatedCopies(r.engine)
    prompt = r.scenario.tokens(33)
    table = r.scenario.allocate(33)
    handle = r.engine.store(prompt, table)
    await gate.wait_entered()
    return gate, prompt, table, handle


async def _stored_with_loads_held(r: Rig) -> Tuple[List[int], GatedCopies, List[List[int]]]:
    """A stored 33-token prompt, a gate that will hold loads' host -> device copies, and fresh device
    blocks for them: (prompt, gate, table)."""
    prompt = r.scenario.tokens(33)
    await r.scenario.produce(prompt)
    gate = GatedCopies(r.engine, "scatter_many_groups")
    return prompt, gate, r.scenario.allocate(33)


# -------------------------------------------------------- a cancel cancels only its own wait


@pytest.mark.asyncio
async def test_cancelling_flush_does_not_cancel_an_in_flight_store(tmp_path):
    r = await rig(tmp_path)
    gate, prompt, table, handle = await _store_held_in_its_copy(r)
    await cancel_soon(r.engine.flush())
    gate.open()
    await asyncio.wait_for(handle.wait_released(), 5)
    assert await asyncio.wait_for(handle.wait_durable(), 5) is True
    assert r.engine.lookup(prompt + [1]) == 32
    await r.close()


@pytest.mark.asyncio
async def test_cancelling_close_lets_a_load_finish_into_its_own_blocks(tmp_path):
    r = await rig(tmp_path)
    prompt, gate, table = await _stored_with_loads_held(r)
    load = asyncio.ensure_future(r.engine.load(prompt + [1], 32, table))
    await gate.wait_entered()
    await cancel_soon(r.engine.close())
    # The load's copy still runs: its slots stay pinned and its blocks fenced until it ends.
    fence = asyncio.ensure_future(r.engine.fence(table[0]))
    await asyncio.sleep(0.05)
    assert not fence.done()
    gate.open()
    await asyncio.wait_for(fence, 5)
    # The caller was never cancelled: it gets a result or ClosedError, never CancelledError.
    try:
        result = await asyncio.wait_for(load, 5)
    except ClosedError:
        pass
    else:
        assert result.ok
    r.scenario._check_bytes(r.engine.request_keys(prompt), table, {0: {0, 1}})
    await asyncio.wait_for(r.engine.close(), 5)  # the second close finishes
    assert r.engine.closed
    assert all(p.closed for p in r.engine.host.pools)
    await r.seam.inner.close()


@pytest.mark.asyncio
async def test_cancelling_a_load_never_lets_a_late_copy_write_into_reused_blocks(tmp_path):
    r = await rig(tmp_path)
    prompt, gate, table = await _stored_with_loads_held(r)
    await cancel_soon(r.engine.load(prompt + [1], 32, table), ticks=5)
    await gate.wait_entered()
    fence = asyncio.ensure_future(r.engine.fence(table[0]))
    await asyncio.sleep(0.02)
    assert not fence.done(), "the blocks of a cancelled load are still being written"
    gate.open()
    await asyncio.wait_for(fence, 5)
    r.scenario._check_bytes(r.engine.request_keys(prompt), table, {0: {0, 1}})
    await r.close()


# -------------------------------------------------------- any exception at a worker boundary


@pytest.mark.asyncio
@pytest.mark.parametrize("error", [ValueError("codec: unknown dtype float4_e2m1"), MemoryError(), ConnectionResetError()])
async def test_a_spill_failing_with_a_foreign_exception_is_not_durable(tmp_path, error, caplog):
    r = await rig(tmp_path)
    r.seam.fail_next("put_many", error)
    prompt = r.scenario.tokens(33)
    with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
        first = await r.scenario.produce(prompt)
    assert first.durable is False
    assert any("spill" in rec.getMessage() for rec in caplog.records)
    assert r.engine.statistics()["chunks_on_disk"] == 0
    assert await r.seam.inner.contains_many(list(r.engine.request_keys(prompt).keys[0])) == [False, False]
    assert r.engine.metrics.snapshot()["dropped"].get("tier_error") == 2
    # The spill loop survived: the next store reaches the disk.
    other = r.scenario.tokens(33)
    assert (await r.scenario.produce(other)).durable is True
    # The failed chunks stay usable from host and their slots are evictable.
    await r.scenario.consume(prompt + [1], expect_hit=32)
    await r.close()


# -------------------------------------------------------------------- a tier's own evictions


@pytest.mark.asyncio
async def test_file_tier_evictions_leave_the_engine_index(tmp_path):
    inner = await FileTier.open(tmp_path / "files", capacity_bytes=6000)
    r = await rig(tmp_path, inner=inner, host_capacity_bytes=4 * 1024)
    prompts = [r.scenario.tokens(17) for _ in range(12)]
    for prompt in prompts:
        await r.scenario.produce(prompt)
    await r.engine.flush()
    on_disk = set(await inner.list_keys())
    assert len(on_disk) < 12, "the tier's capacity must have evicted something"
    for prompt in prompts:
        keys = r.engine.request_keys(prompt + [1])
        hit = r.engine.lookup(keys)
        if keys.keys[0][0] in r.engine.host.entries:
            continue
        assert (hit == 16) == (keys.keys[0][0] in on_disk)
    await r.close()


# ------------------------------------------------------------ hits larger than the host pool


@pytest.mark.asyncio
async def test_a_hit_larger_than_the_host_pool_loads_in_windows(tmp_path):
    # 4 host slots (the floor); the prompt has 24 chunks, stored by "chunked prefill".
    r = await rig(tmp_path, host_capacity_bytes=1, num_blocks=64)
    prompt = r.scenario.tokens(24 * 16 + 1)
    table = r.scenario.allocate(len(prompt))
    for g, blocks in enumerate(table):
        for layer in r.scenario._layers(g):
            for block in blocks:
                layer[block].copy_(torch.randn_like(layer[block]))
    keys = r.engine.request_keys(prompt)
    for step in range(1, 25):
        handle = r.engine.store(keys, table, step * 16)
        result = await handle
        assert result.durable, (step, result.drop_reason)
        for g, chunk in handle.scheduled:
            r.scenario.producer_bytes[keys.keys[g][chunk]] = [r.scenario._block_bytes(g, table[g][chunk])]
    r.scenario.free(table)
    assert r.engine.lookup(keys) == 24 * 16
    await r.scenario.consume(prompt, expect_hit=24 * 16, expect_loaded={0: set(range(24))})
    await r.close()


@pytest.mark.parametrize("host_policy", ["lru", "arc"])
@pytest.mark.asyncio
async def test_a_windowed_load_keeps_the_host_only_chunks_of_its_later_windows(tmp_path, host_policy):
    # 4 host slots, so a load runs in windows of 2. Chunks 2 and 3 are on the host only (their
    # records deleted), chunks 0 and 1 on disk only: the first window's promotions must not evict
    # chunks 2 and 3, which nothing could read again, although lookup admitted them.
    r = await rig(tmp_path, host_capacity_bytes=1, host_eviction_policy=host_policy)
    assert r.engine.host.pools[0].num_slots == 4
    prompt = r.scenario.tokens(4 * 16 + 1)
    keys = r.engine.request_keys(prompt)
    await r.scenario.produce(prompt, expect_stored={0: range(4)})
    await r.engine.flush()
    assert await r.seam.inner.delete_many([keys.keys[0][2], keys.keys[0][3]]) == 2
    await r.engine.flush()
    other = await r.scenario.produce(r.scenario.tokens(2 * 16 + 1), expect_stored={0: range(2)})
    assert other.durable
    await r.engine.flush()
    resident = {k for k in keys.keys[0][:4] if k in r.engine.host.entries}
    assert resident == {keys.keys[0][2], keys.keys[0][3]}
    await r.scenario.consume(prompt, expect_hit=64, expect_loaded={0: range(4)})
    await r.close()


@pytest.mark.asyncio
async def test_a_128k_token_hit_loads_through_a_host_pool_of_four_slots(tmp_path):
    # 131072 tokens = 512 chunks of 256 tokens, stored two chunks at a time (chunked prefill);
    # the host pool holds 4 chunks. The load streams them through in windows of 2.
    layout = ModelLayout(groups=(AttentionGroup(256),))
    inner = await LmdbTier.open(tmp_path / "lmdb", map_size_bytes=64 << 20)
    seam = SeamTier(inner)
    device = make_cpu_device(layout, num_blocks=1025, num_layers=1, kv_heads=1, head_dim=2)
    engine = OffloadEngine(layout, device, config(tmp_path, host_capacity_bytes=1), fingerprint=FINGERPRINT,
                           disk_tier=seam, pressure_sources={"host_memory": ScriptedSource([0.0])})
    await engine.start()
    assert engine.host.pools[0].num_slots == 4
    layer = device._groups[0].layers[0]
    prompt = list(range(131073))
    keys = engine.request_keys(prompt)
    produced = list(range(1, 513))
    layer[produced] = torch.randn_like(layer[produced])
    expected = layer[produced].clone()
    for step in range(1, 257):
        result = await engine.store(keys, [produced], step * 512)
        assert result.durable and len(result.scheduled) == 2, (step, result)
    layer[produced] = 0
    assert engine.lookup(keys) == 131072
    consumer = list(range(513, 1025))
    loaded = await engine.load(keys, 131072, [consumer])
    assert loaded.ok and loaded.chunks_from_disk >= 508 and len(loaded.loaded) == 512
    assert torch.equal(layer[consumer], expected)
    await engine.flush()
    engine.check()
    await engine.close()
    await inner.close()


# ----------------------------------------------------------- index refresh and queued spills


@pytest.mark.asyncio
async def test_refresh_does_not_drop_a_queued_spill(tmp_path):
    r = await rig(tmp_path)
    hold = r.seam.hold_next("put_many")
    first = r.scenario.tokens(17)
    await r.scenario.produce(first, wait_durable=False)
    await hold.entered.wait()  # the spill loop is busy with the first batch
    prompt = r.scenario.tokens(17)
    table = r.scenario.allocate(17)
    handle = r.engine.store(prompt, table)
    await handle.wait_released()  # queued behind the held batch
    # Another writer puts the same chunk meanwhile, and a refresh tells the engine.
    key = r.engine.request_keys(prompt).keys[0][0]
    entry = r.engine.host.entries[key]
    items = [(key, r.engine.host.chunk_meta(entry), memoryview(r.engine.host.pools[0].view(entry.slot).numpy()))]
    await r.seam.inner.put_many(items)
    await r.engine.refresh_disk_index()
    hold.release()
    assert await asyncio.wait_for(handle.wait_durable(), 5) is True
    await r.engine.flush()
    assert r.engine.host.pools[0].statistics()["evictable_slots"] == 2
    await r.close()


# ----------------------------------------------------------------- durable only when on disk


@pytest.mark.asyncio
async def test_a_store_finding_its_chunks_in_flight_is_durable_only_when_they_are(tmp_path):
    r = await rig(tmp_path)
    gate, prompt, table, first = await _store_held_in_its_copy(r)
    second = r.engine.store(prompt, table)  # finds both chunks PENDING
    assert second.skipped == ((0, 0), (0, 1))
    r.seam.fail_next("put_many", KvtierError("disk gone"))
    gate.open()
    assert await asyncio.wait_for(first.wait_durable(), 5) is False
    assert await asyncio.wait_for(second.wait_durable(), 5) is False
    await r.close()


@pytest.mark.asyncio
async def test_a_store_finding_its_chunks_queued_waits_for_their_spill(tmp_path):
    r = await rig(tmp_path)
    hold = r.seam.hold_next("put_many")
    prompt = r.scenario.tokens(33)
    table = r.scenario.allocate(33)
    first = r.engine.store(prompt, table)
    await hold.entered.wait()
    second = r.engine.store(prompt, table)
    await asyncio.sleep(0.02)
    assert not second.durable_known
    hold.release()
    assert await asyncio.wait_for(second.wait_durable(), 5) is True
    assert await first.wait_durable() is True
    await r.close()


# --------------------------------------------------- removals ordered by the tier's sequence


@pytest.mark.asyncio
async def test_an_eviction_reported_before_the_spill_returns_stays_evicted(tmp_path):
    # Disk capacity for ~2 chunks: batch 2's commit evicts batch 1's chunk; batch 1's put answer is
    # held until that removal has reached the engine.
    r, inner, hold = await _small_disk_answer_held(tmp_path)
    first = r.scenario.tokens(17)
    await r.scenario.produce(first, wait_durable=False)
    key = await _evict_while_the_answer_waits(r, inner, hold, first)  # batch 1 evicted while its answer waited
    await r.engine.flush()
    assert r.engine.lookup(first + [1]) == (16 if key in r.engine.host.entries else 0)
    assert key not in r.engine.disk_index
    await r.close()


@pytest.mark.asyncio
async def test_a_spill_whose_key_was_evicted_before_its_answer_is_not_durable(tmp_path):
    # The put landed, then another writer's records evicted its key, and that removal reached the
    # engine before the put's answer: the index refuses the key, so the handle is not durable.
    r, inner, hold = await _small_disk_answer_held(tmp_path)
    first = r.scenario.tokens(17)
    produced = asyncio.ensure_future(r.scenario.produce(first))  # waits for wait_durable()
    key = await _evict_while_the_answer_waits(r, inner, hold, first)
    record = await produced
    assert (record.durable, key in r.engine.disk_index) == (False, False)
    await r.close()


@pytest.mark.asyncio
async def test_refresh_does_not_re_add_a_key_evicted_during_the_listing(tmp_path):
    inner = await _small_disk(tmp_path)
    r = await rig(tmp_path, inner=inner, host_capacity_bytes=1)
    prompt = r.scenario.tokens(17)
    await r.scenario.produce(prompt)
    key = r.engine.request_keys(prompt).keys[0][0]
    hold = r.seam.hold_next("list_keys", after=True)
    refresh = asyncio.ensure_future(r.engine.refresh_disk_index())
    await hold.entered.wait()  # the listing holds the key
    await _another_writer_evicts(r, inner, key)
    hold.release()
    await refresh
    assert key not in r.engine.disk_index
    await r.close()


async def _small_disk(tmp_path) -> LmdbTier:
    """A disk tier with room for about two chunks, so a few more records evict the oldest."""
    return await LmdbTier.open(tmp_path / "lmdb", map_size_bytes=64 << 20, capacity_bytes=5000)


async def _small_disk_answer_held(tmp_path) -> Tuple[Rig, LmdbTier, Gate]:
    """A rig over the small disk whose next put's answer is held after it committed: (rig, the
    disk, the hold)."""
    inner = await _small_disk(tmp_path)
    r = await rig(tmp_path, inner=inner)
    return r, inner, r.seam.hold_next("put_many", after=True)


async def _evict_while_the_answer_waits(r: Rig, inner: LmdbTier, hold: Gate, prompt: List[int]) -> bytes:
    """Once the held put committed, another writer evicts ``prompt``'s first chunk; then the put's
    answer goes on. Returns that chunk's key."""
    await hold.entered.wait()
    key = r.engine.request_keys(prompt).keys[0][0]
    await _another_writer_evicts(r, inner, key)
    hold.release()
    return key


async def _another_writer_evicts(r: Rig, inner: LmdbTier, key: bytes) -> None:
    """Another writer's records fill the small disk past `key`, and its removal reaches the engine."""
    for _ in range(3):
        await r.seam.inner.put_many([_raw_item(r.engine, os.urandom(32))])
    await asyncio.sleep(0.05)  # the removal callbacks run on the loop
    assert await inner.contains_many([key]) == [False]


def _raw_item(engine: OffloadEngine, key: bytes):
    """A record another writer puts straight into the tier (same layout and meta as the engine's)."""
    nbytes = engine.host.chunk_nbytes[0]
    dtype, shape = engine.host.metas[0]
    from kvtier.tiers.base import ChunkMeta

    return key, ChunkMeta(engine.fingerprint, 0, 0, dtype, shape), memoryview(bytearray(os.urandom(nbytes)))


# ------------------------------------------------------------------ failed and stalled reads


@pytest.mark.asyncio
async def test_a_read_failing_with_a_foreign_exception_fails_the_load_at_once(tmp_path):
    r = await rig(tmp_path, host_capacity_bytes=1, tier_timeout_s=30.0)
    prompt = r.scenario.tokens(17 * 4)
    await r.scenario.produce(prompt)
    for _ in range(4):  # evict the host copies so the load reads the disk
        await r.scenario.produce(r.scenario.tokens(17 * 4))
    r.seam.fail_next("get_many_into", ValueError("third-party tier bug"))
    table = r.scenario.allocate(len(prompt))
    result = await asyncio.wait_for(r.engine.load(prompt, 64, table), 2)
    assert (result.ok, result.reason) == (False, "tier_error")
    assert r.engine.lookup(prompt) == 64  # nothing left LOADING
    await r.scenario.consume(prompt, expect_hit=64)
    await r.close()


@pytest.mark.asyncio
async def test_a_stalled_prefetch_read_times_out(tmp_path):
    r = await rig(tmp_path, host_capacity_bytes=1, tier_timeout_s=0.2)
    prompt = r.scenario.tokens(17 * 4)
    await r.scenario.produce(prompt)
    for _ in range(4):
        await r.scenario.produce(r.scenario.tokens(17 * 4))
    r.seam.stall("get_many_into")
    assert await r.engine.prefetch(prompt) == 4
    assert r.engine.lookup(prompt) is None
    await asyncio.sleep(0.4)
    assert r.engine.lookup(prompt) == 64, "an abandoned read leaves lookup answering from disk again"
    r.seam.heal()
    await r.engine.flush()  # the abandoned read ends; its slots are released
    await r.scenario.consume(prompt, expect_hit=64)
    await r.close()


@pytest.mark.asyncio
async def test_a_timed_out_read_keeps_its_slots_until_the_tier_lets_go(tmp_path):
    # Eight host slots. A prefetch read of four chunks stalls past the timeout and is abandoned;
    # the tier still holds the four buffers, so the slots stay pinned until it reports. A store
    # meanwhile takes the other four; the late read then lands in its own slots, never in the
    # store's (whose host copies the load below checks bitwise).
    nbytes = make_cpu_device(FULL, num_blocks=128).chunk_nbytes(0)
    r = await rig(tmp_path, host_capacity_bytes=8 * nbytes, tier_timeout_s=0.2)
    pool = r.engine.host.pools[0]
    prompt = r.scenario.tokens(17 * 4)
    await r.scenario.produce(prompt)
    for _ in range(2):  # eight other chunks push the prompt's host copies out
        await r.scenario.produce(r.scenario.tokens(17 * 4))
    keys = r.engine.request_keys(prompt).keys[0][:4]
    assert not any(k in r.engine.host.entries for k in keys)
    r.seam.stall("get_many_into")
    assert await r.engine.prefetch(prompt) == 4
    await asyncio.sleep(0.4)
    assert r.engine.lookup(prompt) == 64  # abandoned: lookup answers from the disk again
    assert pool.statistics()["pinned_slots"] == 4  # the read's slots, held for the tier
    later = r.scenario.tokens(17 * 4)
    await r.scenario.produce(later)
    assert pool.statistics()["pinned_slots"] == 4
    r.seam.heal()
    await r.engine.flush()  # the late read reports; its result is discarded, its slots freed
    assert pool.statistics()["pinned_slots"] == 0
    assert all(r.engine.host.entries[k].state.name == "READY" for k in r.engine.request_keys(later).keys[0][:4])
    await r.scenario.consume(later + [1], expect_hit=64)  # from the host copies, bitwise
    await r.close()


# ---------------------------------------------------------- bounded events, exported metrics


@pytest.mark.asyncio
async def test_events_are_bounded_and_drops_counted(tmp_path):
    r = await rig(tmp_path, events_max=8)
    for _ in range(4):
        await r.scenario.produce(r.scenario.tokens(33))
    events = r.engine.take_events()
    assert len(events) == 8
    assert r.engine.metrics.snapshot()["events_dropped"] == 4 * 2 * 2 - 8
    assert [e.kind for e in events][-1] == "stored"
    await r.close()


@pytest.mark.asyncio
async def test_pressure_metric_and_chunk_states_are_exported(tmp_path):
    source = ScriptedSource([0.0])
    r = await rig(tmp_path, sources={"host_memory": source}, pressure_poll_interval_s=0.01)
    prompt = r.scenario.tokens(33)
    await r.scenario.produce(prompt)
    text = r.engine.metrics.exposition().decode()
    assert 'kvtier_chunks{state="ready"} 2.0' in text
    assert "kvtier_pressure_high 0.0" in text
    source.extend([0.99])
    for _ in range(100):
        await asyncio.sleep(0.01)
        if r.engine.pressure.paused:
            break
    handle = r.engine.store(r.scenario.tokens(33), r.scenario.allocate(33))
    assert handle.drop_reason == "pressure"
    assert "kvtier_pressure_high 1.0" in r.engine.metrics.exposition().decode()
    await r.close()


# ---------------------------------------------------------------------------------- suspicions


@pytest.mark.asyncio
async def test_a_failed_second_group_allocation_evicts_nothing_in_the_first(tmp_path):
    # Four slots per group. A is on disk (evictable); with spills stalled, B and C fill group 1
    # with unspilled chunks. D then needs group-0 slots (one free, A's evictable) and group-1
    # slots (none): the store fails, and A's host copy must survive the attempt.
    r = await rig(tmp_path, HYBRID, host_capacity_bytes=1)
    assert [p.num_slots for p in r.engine.host.pools] == [4, 4]
    a = r.scenario.tokens(16)
    await r.scenario.produce(a)
    r.seam.stall("put_many")
    await r.scenario.produce(r.scenario.tokens(16), wait_durable=False)
    await r.scenario.produce(r.scenario.tokens(16), wait_durable=False)
    a_key = r.engine.request_keys(a).keys[0][0]
    assert a_key in r.engine.host.entries
    handle = r.engine.store(r.scenario.tokens(33), r.scenario.allocate(33))
    assert handle.drop_reason == "host_full"
    assert a_key in r.engine.host.entries, "nothing may be evicted for an allocation that fails"
    await r.close()


def test_host_memory_source_leaves_out_the_engines_own_slab():
    from kvtier.engine.pressure import host_memory_source

    import psutil

    vm = psutil.virtual_memory()
    slab = vm.total // 4
    plain = host_memory_source()()
    own = host_memory_source(own_bytes=lambda: slab)()
    assert plain is not None and own is not None
    assert own == pytest.approx(max(0.0, (vm.total - vm.available - slab) / vm.total), abs=0.05)
    assert own < plain


@pytest.mark.asyncio
async def test_an_engine_used_in_a_forked_child_says_so(tmp_path):
    from kvtier.errors import ForkedProcessError

    r = await rig(tmp_path)
    prompt = r.scenario.tokens(33)
    pid = os.fork()
    if pid == 0:  # the child: every call refuses before touching the parent's threads or tiers
        code = 1
        try:
            r.engine.lookup(prompt)
        except ForkedProcessError as exc:
            code = 0 if "pid" in str(exc) else 3
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert r.engine.lookup(prompt) == 0  # the parent is unaffected
    await r.close()


@pytest.mark.asyncio
async def test_store_and_load_order_copies_after_the_callers_compute_stream(tmp_path):
    # The order is an event recorded on the caller's stream, on the caller's thread, when store()
    # and load() are called; the copy threads are handed that event (see also
    # test_engine_device_order.py, which runs the CUDA code path on CPU).
    r = await rig(tmp_path)
    backend = r.engine.device.backend
    seen = []
    caller = threading.get_ident()
    backend.current_stream = lambda: ("stream-of", threading.get_ident())
    backend.record_event = lambda stream: ("event-on", stream, threading.get_ident())
    for method in ("gather_many_groups", "scatter_many_groups"):
        real = getattr(r.engine.device, method)

        def recording(items, *, ready_event=None, wait=True, _real=real, _name=method):
            seen.append((_name, ready_event))
            return _real(items, ready_event=ready_event, wait=wait)

        setattr(r.engine.device, method, recording)
    prompt = r.scenario.tokens(33)
    await r.scenario.produce(prompt)
    await r.scenario.consume(prompt + [1], expect_hit=32)
    assert seen == [
        ("gather_many_groups", ("event-on", ("stream-of", caller), caller)),
        ("scatter_many_groups", ("event-on", ("stream-of", caller), caller)),
    ]
    await r.close()


@pytest.mark.asyncio
async def test_an_engine_called_from_another_event_loop_refuses_before_scheduling(tmp_path):
    r = await rig(tmp_path)
    prompt = r.scenario.tokens(33)
    table = r.scenario.allocate(33)
    errors = []

    def other_loop():
        async def call():
            try:
                r.engine.store(prompt, table)
            except KvtierError as exc:
                errors.append(exc)

        asyncio.run(call())

    thread = threading.Thread(target=other_loop)
    thread.start()
    thread.join(5)
    assert len(errors) == 1 and "event loop" in str(errors[0])
    assert not r.engine.host.entries
    await r.close()



# ---------------------------------------------------------------------------------- supervision


@pytest.mark.asyncio
async def test_a_crashed_spill_loop_restarts_and_then_the_engine_fails_loudly(tmp_path, caplog):
    from kvtier.errors import EngineUsageError

    r = await rig(tmp_path)
    spill = r.engine._spill
    real = spill._next_batch
    crashes = {"left": 1}

    def flaky():
        if crashes["left"]:
            crashes["left"] -= 1
            raise RuntimeError("a bug in the spill loop")
        return real()

    spill._next_batch = flaky
    with caplog.at_level(logging.ERROR, logger="kvtier.engine"):
        assert (await r.scenario.produce(r.scenario.tokens(33))).durable is True  # restarted
    assert any("restarting" in rec.getMessage() for rec in caplog.records)
    assert r.engine.metrics.snapshot()["worker_errors"]["spill_loop"] == 1

    crashes["left"] = 10  # keeps crashing: the engine gives up and says so
    handle = r.engine.store(r.scenario.tokens(33), r.scenario.allocate(33))
    assert await asyncio.wait_for(handle.wait_durable(), 5) is False
    with pytest.raises(EngineUsageError, match="failed"):
        r.engine.lookup([1] * 33)
    spill._next_batch = real
    await r.close(check=False)


@pytest.mark.asyncio
async def test_the_lifecycle_table_refuses_a_move_it_does_not_list(tmp_path):
    from kvtier.engine.lifecycle import HostState, IllegalTransition, move
    from kvtier.engine.records import ChunkEntry

    entry = ChunkEntry(b"k" * 32, 0, 0, HostState.READY, 0)
    with pytest.raises(IllegalTransition, match="ready -> spilling"):
        move(entry, HostState.SPILLING)
    entry = ChunkEntry(b"k" * 32, 0, 0, HostState.PENDING, 0)
    move(entry, HostState.QUEUED)
    move(entry, HostState.SPILLING)
    move(entry, HostState.READY)
    assert entry.state is HostState.READY


# ---------------------------------------------------------------------------------- FileTier suspicion


@pytest.mark.asyncio
@pytest.mark.parametrize("waiter", ["flush", "close", "delete_many"])
async def test_cancelling_a_file_tier_wait_does_not_cancel_an_in_flight_put(tmp_path, monkeypatch, waiter):
    # Suspicion settled (it reproduced): FileTier's flush/close/delete_many gathered over the tier's
    # own tasks, so cancelling one of them cancelled a put another caller was awaiting.
    import kvtier.tiers.files.writes as file_tier_module  # the put path (encoding) lives there
    from kvtier.tiers.base import ChunkMeta

    entered, gate = threading.Event(), threading.Event()
    real_encode = file_tier_module._encode_slice

    def held_encode(part, codec):
        entered.set()
        gate.wait(10)
        return real_encode(part, codec)

    monkeypatch.setattr(file_tier_module, "_encode_slice", held_encode)
    tier = await FileTier.open(tmp_path / "files")
    key = os.urandom(32)
    raw = memoryview(bytearray(os.urandom(1 << 16)))
    put = asyncio.ensure_future(tier.put_many([(key, ChunkMeta(b"x", 0, 0, "uint8", (1 << 16,)), raw)]))
    assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
    wait = asyncio.ensure_future(tier.delete_many([key]) if waiter == "delete_many" else getattr(tier, waiter)())
    await asyncio.sleep(0.02)
    wait.cancel()
    await asyncio.sleep(0.02)
    gate.set()
    assert isinstance(await asyncio.wait_for(put, 5), int), "the put's caller was never cancelled"
    await asyncio.gather(wait, return_exceptions=True)
    await tier.close()
    monkeypatch.undo()
    reopened = await FileTier.open(tmp_path / "files")
    assert await reopened.contains_many([key]) == [True]
    await reopened.close()


# ----------------------------------------------------------------- host hits and the disk's LRU


async def _rig_in_chunks(tmp_path, host_chunks: int, disk_chunks: int):
    """A rig whose host holds ``host_chunks`` FULL chunks (LRU: the tests spell out its order; the
    default ARC would keep a chunk used twice) over an LMDB tier of ``disk_chunks`` uncompressed
    records, and the list of keys that tier removes, as it removes them."""
    from kvtier.tiers.base import ChunkMeta
    from kvtier.tiers.record_format import CodecConfig, encode_record

    raw = CodecConfig(compress=False)
    nbytes = make_cpu_device(FULL, num_blocks=128).chunk_nbytes(0)
    probe = await rig(tmp_path / "probe")
    dtype, shape = probe.engine.host.metas[0]
    await probe.close()
    record = len(encode_record(b"k" * 32, ChunkMeta(FINGERPRINT, 0, 0, dtype, tuple(shape)), memoryview(bytes(nbytes)), raw))
    inner = await LmdbTier.open(tmp_path / "lmdb", capacity_bytes=disk_chunks * record, codec=raw)
    r = await rig(tmp_path, inner=inner, host_capacity_bytes=host_chunks * nbytes, host_eviction_policy="lru")
    removed: List[bytes] = []
    inner.subscribe_removals(lambda removals: removed.extend(x.key for x in removals))
    return r, removed


@pytest.mark.asyncio
async def test_a_chunk_kept_hot_on_the_host_does_not_age_out_of_the_disk(tmp_path):
    # Host: 8 chunks; disk: 12 records. H is stored, then A; H is used again from the host. When
    # the disk must evict four records, the oldest use is A's, not H's: the load told the disk
    # tier of the host hit (touch_many). Without that, the disk evicted H while the host dropped
    # its copy too, and H was gone for good (a store that finds a chunk on the host never writes
    # it again).
    r, removed = await _rig_in_chunks(tmp_path, 8, 12)
    hot, a, b, c = (r.scenario.tokens(17 * 4) for _ in range(4))
    for prompt in (hot, a):
        await r.scenario.produce(prompt)
    await r.scenario.consume(hot + [1], expect_hit=64)  # from the host
    await r.scenario.produce(b)  # the host drops A's copies; the disk is full: A, H, B
    await r.scenario.produce(c)  # the host drops H's copies; the disk evicts A, its oldest use
    await r.engine.flush()
    keys = {name: set(r.engine.request_keys(p).keys[0][:4]) for name, p in (("hot", hot), ("a", a))}
    assert set(removed) == keys["a"]
    assert not any(k in r.engine.host.entries for k in keys["hot"])
    assert (await r.scenario.consume(hot + [1], expect_hit=64)).ok  # from the disk, bitwise
    await r.close()


@pytest.mark.asyncio
async def test_a_store_finding_a_chunk_on_the_host_alone_keeps_it_there(tmp_path):
    # Host: 8 chunks (LRU); disk: 4 records. B's store evicts A from the disk; the host keeps A.
    # A's next store finds A on the host alone and skips it (not durable), but counts it as a use
    # there, as one cache would take A in again: C's store then evicts B from the host, not A.
    # The store used to leave A the host's oldest chunk, so C's store dropped it for good (on a
    # hybrid layout: a window of sliding chunks lost while the full-attention chunks stored with
    # it stayed, so the next hit stopped at the first chunk).
    r, removed = await _rig_in_chunks(tmp_path, 8, 4)
    a, b, c = (r.scenario.tokens(17 * 4) for _ in range(3))
    keys = {name: r.engine.request_keys(p).keys[0][:4] for name, p in (("a", a), ("b", b))}
    for prompt in (a, b):
        assert (await r.scenario.produce(prompt)).durable is True
    await r.engine.flush()
    assert set(removed) == set(keys["a"]) and all(k in r.engine.host.entries for k in keys["a"])
    assert (await r.scenario.produce(a, expect_stored={})).durable is False  # on the host alone
    await r.scenario.produce(c)
    await r.engine.flush()
    assert all(k in r.engine.host.entries for k in keys["a"])
    assert not any(k in r.engine.host.entries for k in keys["b"])
    assert (await r.scenario.consume(a + [1], expect_hit=64)).ok  # from the host, bitwise
    await r.close()
