"""The public API on bad input: each mistake is a typed error naming the argument and the
value, raised before anything is scheduled; integer-like values that are exact (numpy and torch
integer scalars and arrays) work; settings that can never work are refused where they are known,
and drops that follow from tight settings are logged (rate-limited) and counted."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import List, Tuple

import numpy as np
import pytest
import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.engine.drop_log import DropLog
from kvtier.errors import EngineUsageError
from kvtier.errors import DeviceError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.device import DeviceKVView
from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT as LAYOUT
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

FINGERPRINT = b"api-edges"


def an_engine(config: EngineConfig = None, layout: ModelLayout = LAYOUT) -> OffloadEngine:
    """An engine of ``layout`` on a CPU device, not started: ``async with`` starts and closes it."""
    return OffloadEngine(layout, make_cpu_device(layout), config or EngineConfig(host_capacity_bytes=4 << 20, pressure_poll_interval_s=3600.0),
                         fingerprint=FINGERPRINT)


async def produced(engine: OffloadEngine, n: int) -> Tuple[OffloadScenario, List[int]]:
    """A scenario on ``engine`` and a prompt of ``n`` tokens it stored."""
    scenario = OffloadScenario(engine)
    tokens = scenario.tokens(n)
    await scenario.produce(tokens)
    return scenario, tokens


def nothing_scheduled(engine: OffloadEngine) -> bool:
    return engine.statistics()["chunks_by_state"] == {"pending": 0, "ready": 0, "loading": 0}


@pytest.mark.asyncio
async def test_bad_token_ids_and_counts_are_typed_errors_naming_the_argument():
    async with an_engine() as engine:
        table = [[1, 2, 3], list(range(1, 10))]
        tokens = list(range(33))
        cases = [
            (lambda: engine.store(b"\x01\x02" * 20, table), TypeError, r"token_ids must be a sequence of ints, got bytes"),
            (lambda: engine.lookup(np.arange(33, dtype=np.float32)), TypeError, r"token_ids must be a 1-D integer array, got a 1-D array of float32"),
            (lambda: engine.lookup(torch.ones(33, dtype=torch.bool)), TypeError, r"token_ids must be a 1-D integer tensor, got a 1-D tensor of torch.bool"),
            (lambda: engine.lookup(np.zeros((2, 33), dtype=np.int64)), TypeError, r"token_ids must be a 1-D integer array, got a 2-D array of int64"),
            (lambda: engine.store(tokens, table, 32.0), TypeError, r"num_tokens must be an int .*got float 32\.0"),
            (lambda: engine.lookup(tokens, max_tokens=True), TypeError, r"max_tokens must be an int .*got bool True"),
        ]
        for call, kind, message in cases:
            with pytest.raises(kind, match=message):
                call()
        with pytest.raises(TypeError, match=r"hit_tokens must be an int .*got bool True"):
            await engine.load(tokens, True, table)
        assert nothing_scheduled(engine)

        # Exact integers of numpy and torch are fine, and name the same chunks as plain ints.
        as_list = engine.request_keys(tokens)
        assert engine.request_keys(np.arange(33, dtype=np.int64)) == as_list
        assert engine.request_keys(torch.arange(33)) == as_list
        assert engine.request_keys(range(33)) == as_list
        assert engine.request_keys(t for t in tokens) == as_list  # an iterator is read once
        handle = engine.store(tokens, table, np.int64(32))
        assert handle.scheduled and not handle.dropped
        await handle.wait_released()
        assert engine.lookup(tokens + [5], max_tokens=np.int64(32)) == 32


@pytest.mark.asyncio
async def test_block_ids_must_be_integers_distinct_and_nested():
    async with an_engine() as engine:
        tokens = list(range(33))
        cases = [
            ([[0, 1.9, 2.5], list(range(1, 10))], TypeError, r"block_table\[0\]\[1\] must be an int .*got float 1\.9"),
            ([[1, 2, 3], ["1", 2, 3, 4, 5, 6, 7, 8, 9]], TypeError, r"block_table\[1\]\[0\] must be an int .*got str '1'"),
            ([[1, 2, 3], [1, 2, True, 4, 5, 6, 7, 8, 9]], TypeError, r"block_table\[1\]\[2\] must be an int .*got bool True"),
            ([1, 2], TypeError, r"block_table\[0\] must be a sequence of device block ids, got int 1 \(block_table is nested"),
            ([[1, 2, 3], None], TypeError, r"block_table\[1\] must be a sequence of device block ids, got NoneType None"),
            ([[1, 2, 3], [1, 2, None, 4, 5, 6, 7, 8, 9]], ValueError, r"block_table\[1\]\[2\] is None, but the store reads logical block 2"),
            ([[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 3, 9]], ValueError, r"block_table\[1\] gives device block 3 to logical blocks 2 and 7"),
            ([[1, 2, 3], np.arange(9, dtype=np.float64)], TypeError, r"block_table\[1\] must be a 1-D integer array, got a 1-D array of float64"),
        ]
        for table, kind, message in cases:
            with pytest.raises(kind, match=message):
                engine.store(tokens, table)
        assert nothing_scheduled(engine)
        with pytest.raises(TypeError, match=r"block_table\[0\]\[0\] must be an int .*got float 1\.0"):
            await engine.load(tokens, 32, [[1.0, 2.0], list(range(1, 9))])

        # numpy and torch integers store exactly the blocks they name, bitwise.
        scenario = OffloadScenario(engine)
        record = await scenario.produce(tokens, drop_device_blocks=False)
        keys = engine.request_keys(tokens + [7])
        fresh = scenario.allocate(33)
        table = [np.array(fresh[0], dtype=np.int32), [torch.tensor(b) for b in fresh[1]]]
        result = await engine.load(keys, 32, table)
        assert result.ok, result.reason
        for g, block in result.loaded:
            for layer in scenario._layers(g):
                assert torch.equal(layer[fresh[g][block]].view(torch.uint8), layer[record.block_table[g][block]].view(torch.uint8))
        # A table with a null block shared by blocks the store does not read is fine.
        sparse = scenario.tokens(33)
        handle = engine.store(sparse, [scenario.allocate(33)[0], [0, 0] + scenario.allocate(33)[1][2:]])
        assert not handle.dropped and handle.scheduled
        await handle.wait_released()


def test_settings_that_can_never_work_are_refused_where_they_are_known(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"host_capacity_bytes must be at most 2\*\*62 bytes, got 1208925819614629174706176"):
        EngineConfig(host_capacity_bytes=2**80)
    with pytest.raises(ValueError, match=r"lmdb_map_size_bytes must be >= 1048576, got 1"):
        EngineConfig(cache_dir=str(tmp_path), lmdb_map_size_bytes=1)
    binary = tmp_path / "kvtier.toml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 8)
    with pytest.raises(ValueError, match=rf"'{binary}' is not valid TOML: not UTF-8 text"):
        EngineConfig.from_toml(binary)
    with pytest.raises(ValueError, match=r"host_capacity_bytes \(from KVTIER_HOST_CAPACITY_BYTES\) must be a size"):
        EngineConfig.from_env({"KVTIER_HOST_CAPACITY_BYTES": "lots"})
    with pytest.raises(ValueError, match=r"^host_capacity_bytes must be positive, got 0 \(from KVTIER_HOST_CAPACITY_BYTES\)$"):
        EngineConfig.from_env({"KVTIER_HOST_CAPACITY_BYTES": "0"})
    monkeypatch.setenv("KVTIER_STORE_QUEUE_MAX_CHUNKS", "-3")
    with pytest.raises(ValueError, match=r"store_queue_max_chunks must be positive, got -3 \(from KVTIER_STORE_QUEUE_MAX_CHUNKS\)"):
        EngineConfig.load()
    # Known only against the machine: a pool larger than its memory is refused at construction.
    with pytest.raises(ValueError, match=r"host_capacity_bytes=4611686018427387904 is more than this machine's memory"):
        OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), EngineConfig(host_capacity_bytes=2**62), fingerprint=FINGERPRINT)


@pytest.mark.asyncio
async def test_stores_that_never_fit_are_dropped_logged_once_per_interval_and_counted(caplog):
    caplog.set_level(logging.WARNING, logger="kvtier.engine")
    async with an_engine(EngineConfig(store_queue_max_chunks=2, host_capacity_bytes=4 << 20, pressure_poll_interval_s=3600.0)) as engine:
        scenario = OffloadScenario(engine)
        dropped = [sum(len(b) for b in (await scenario.produce(scenario.tokens(33))).dropped.values()) for _ in range(3)]
        n = dropped[0]
        assert dropped == [n, n, n] and n > 2
        assert engine.statistics()["dropped"]["queue_full"] == 3 * n
        lines = [r.getMessage() for r in caplog.records if "store dropped" in r.getMessage()]
        assert lines == [
            f"store dropped (queue_full): {n} chunks do not fit the store queue (0 in flight, store_queue_max_chunks=2); "
            f"a request this large never fits: raise store_queue_max_chunks [{n} chunks dropped for this reason since "
            "the last such line]"
        ]
    now = [0.0]
    log = DropLog(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
        caplog.clear()
        log.note("host_full", 3, "x")
        log.note("host_full", 4, "x")
        now[0] = 11.0
        log.note("host_full", 5, "x")
    assert [r.getMessage().rsplit("[", 1)[1] for r in caplog.records] == [
        "3 chunks dropped for this reason since the last such line]", "9 chunks dropped for this reason since the last such line]"
    ]


def test_device_views_and_groups_refuse_what_is_not_a_kv_cache():
    layout = ModelLayout((AttentionGroup(16, blocks_per_chunk=2),))
    for dtype in (torch.bool, torch.complex64):
        with pytest.raises(DeviceError, match=rf"group 0, layer 0: dtype {dtype} is not a KV-cache dtype"):
            DeviceKVView(layout, [[torch.zeros(8, 2, 16, 4, dtype=dtype)]])
    for blocks in (0, 1):
        with pytest.raises(DeviceError, match=rf"group 0, layer 0: {blocks} blocks in the first \(block index\) dimension, fewer than one chunk \(2 blocks\)"):
            DeviceKVView(layout, [[torch.zeros(blocks, 2, 16, 4)]])
    with pytest.raises(ValueError, match=r"block_size must be at most 2\*\*31 - 1, got 10{30}"):
        AttentionGroup(10**30)
    with pytest.raises(ValueError, match=r"sliding_window must be at most 2\*\*31 - 1"):
        AttentionGroup(16, sliding_window=2**40)


# -- the promises of round two: each call refuses what it cannot honour, naming the argument ------


@pytest.mark.asyncio
async def test_lookup_max_tokens_past_the_request_costs_what_the_request_costs():
    async with an_engine() as engine:
        _, tokens = await produced(engine, 64)
        expected = engine.lookup(tokens, max_tokens=64)
        assert expected == 64
        began = time.perf_counter()
        # Unclamped, the search walked every granularity step up to max_tokens: 10**8 took ~15 s.
        assert engine.lookup(tokens, max_tokens=10**8) == expected
        assert engine.lookup(tokens, max_tokens=10**30) == expected
        assert time.perf_counter() - began < 2.0


def _in_another_loop(call) -> BaseException:
    """Run ``call()``'s coroutine on a fresh loop in another thread; the exception it raised."""
    caught: list = []

    def body() -> None:
        try:
            asyncio.run(call())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            caught.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10.0)
    assert not thread.is_alive(), "the call hung in another thread"
    assert caught, "the call from another loop was accepted"
    return caught[0]


@pytest.mark.asyncio
async def test_every_call_from_another_loop_or_thread_is_a_usage_error():
    async with an_engine() as engine:
        tokens = list(range(33))
        table = [[1, 2, 3], list(range(1, 10))]
        calls = {
            "close": lambda: engine.close(),
            "flush": lambda: engine.flush(),
            "load": lambda: engine.load(tokens, 32, table),
            "prefetch": lambda: engine.prefetch(tokens),
            "fence": lambda: engine.fence([1]),
        }
        for name, call in calls.items():
            exc = _in_another_loop(call)
            assert type(exc) is EngineUsageError, (name, exc)
            assert str(exc) == ("this OffloadEngine belongs to the event loop that started it; it was called from "
                                "another event loop"), name
        assert not engine.closing  # the refused close changed nothing
    assert engine.closed


@pytest.mark.asyncio
async def test_fence_checks_its_block_ids_as_a_block_table_does():
    async with an_engine() as engine:
        cases = [
            (("0123",), TypeError, r"^block_ids must be a sequence of ints, got str '0123'$"),
            (([1.5],), TypeError, r"^block_ids\[0\] must be an int .*got float 1\.5$"),
            ((None,), TypeError, r"^block_ids must be a sequence of ints, got NoneType None$"),
            (([True],), TypeError, r"^block_ids\[0\] must be an int .*got bool True$"),
            (([10**9],), DeviceError, r"^block_ids\[0\]: device block 1000000000 is out of range \(the largest group's KV cache has \d+ blocks\)$"),
            (([-1], 0), DeviceError, r"^block_ids\[0\]: device block -1 is out of range \(group 0's KV cache has \d+ blocks\)$"),
            (([0], 99), ValueError, r"^group_index must be None or in \[0, 2\), got 99$"),
            (([0], -1), ValueError, r"^group_index must be None or in \[0, 2\), got -1$"),
            (([0], 1.0), TypeError, r"^group_index must be an int .*got float 1\.0$"),
        ]
        for args, kind, message in cases:
            with pytest.raises(kind, match=message):
                await engine.fence(*args)
        # What a block table accepts, a fence accepts: numpy ints, a set, an iterator.
        await engine.fence(np.array([0, 1]), 1)
        await engine.fence({2, 3})
        await engine.fence(iter([4]), np.int64(0))


@pytest.mark.asyncio
async def test_tokens_that_are_not_tokens_and_keys_of_another_layout_are_refused_by_name():
    other_layout = ModelLayout((AttentionGroup(16), AttentionGroup(8, sliding_window=8)))
    async with an_engine() as engine, an_engine(layout=other_layout) as other:
        tokens = list(range(33))
        table = [[1, 2, 3], list(range(1, 10))]
        keys = engine.request_keys(tokens)
        cases = [
            (lambda: engine.store(None, table), r"^token_ids must be a sequence of ints, got NoneType None$"),
            (lambda: engine.lookup(None), r"^token_ids must be a sequence of ints, got NoneType None$"),
            (lambda: engine.lookup({1: 2, 3: 4}), r"^token_ids must be a sequence of ints, got dict \{1: 2, 3: 4\}$"),
            (lambda: engine.lookup(set(tokens)), r"^token_ids must be a sequence of ints, got set "),
            (lambda: engine.lookup([True] * 33), r"^token_ids\[0\] must be an int, got bool True \(a mask is not token ids\)$"),
            (lambda: engine.lookup(7), r"^token_ids must be a sequence of ints, got int 7$"),
            (lambda: keys.extended(None), r"^more_token_ids must be a sequence of ints, got NoneType None$"),
        ]
        for call, message in cases:
            with pytest.raises(TypeError, match=message):
                call()
        with pytest.raises(TypeError, match=r"^timeout_s must be a number of seconds, got str '1'$"):
            await engine.prefetch(tokens, policy="timeout", timeout_s="1")
        for bad in (float("nan"), float("inf"), 0, -1.0):
            with pytest.raises(ValueError, match=r"^timeout_s must be a positive, finite number of seconds, got "):
                await engine.prefetch(tokens, policy="timeout", timeout_s=bad)
        assert await engine.prefetch(tokens, policy="timeout", timeout_s=1) == 0  # an int is a number

        foreign = other.request_keys(tokens)
        message = (r"^these RequestKeys belong to another layout \(2 group\(s\): 16x1, 8x1 window 8; this engine's: "
                   r"16x1, 4x1 window 8\); make them with this engine's request_keys$")
        with pytest.raises(ValueError, match=message):
            engine.store(foreign, table)
        with pytest.raises(ValueError, match=message):
            engine.lookup(foreign)
        with pytest.raises(ValueError, match=message):
            await engine.load(foreign, 16, table)
        assert nothing_scheduled(engine)


@pytest.mark.asyncio
async def test_load_refuses_a_hit_off_the_granularity_and_a_device_block_given_twice():
    async with an_engine() as engine:
        scenario, tokens = await produced(engine, 33)
        fresh = scenario.allocate(33)
        with pytest.raises(ValueError, match=r"^hit_tokens must be a multiple of the layout's hit_granularity_tokens \(4\), got 17$"):
            await engine.load(tokens, 17, fresh)
        twice = [list(fresh[0]), list(fresh[1])]
        twice[0][1] = twice[0][0]
        with pytest.raises(ValueError, match=rf"^block_table\[0\] gives device block {twice[0][0]} to logical blocks 0 and 1; "
                                             "each restored block needs its own device block$"):
            await engine.load(tokens, 32, twice)
        assert engine.statistics()["chunks_by_state"]["loading"] == 0
        result = await engine.load(tokens, 32, fresh)
        assert result.ok, result.reason


def test_layouts_and_device_views_refuse_what_can_never_hit():
    group = AttentionGroup(16, blocks_per_chunk=2)
    with pytest.raises(ValueError, match=r"^alignment_tokens \(7\) must be a multiple of hit_granularity_tokens \(16\)$"):
        ModelLayout((group,), alignment_tokens=7)
    with pytest.raises(ValueError, match=r"^alignment_tokens \(32\) must be a multiple of hit_granularity_tokens \(5\)$"):
        ModelLayout((group,), hit_granularity_tokens=5)
    assert ModelLayout((group,), alignment_tokens=64, hit_granularity_tokens=32).alignment_tokens == 64
    # vLLM's FlashAttention layout puts K and V first: [2, num_blocks, block_size, heads, head_dim].
    flash = ModelLayout((AttentionGroup(16),))
    with pytest.raises(DeviceError, match=r"^group 0, layer 0: shape \(2, 10, 16, 4, 8\) has K and V first "
                                          r"\(\[2, num_blocks, block_size, \.\.\.\]\); the block index must be the first "
                                          r"dimension: pass layer\[0\] and layer\[1\] as two layers$"):
        DeviceKVView(flash, [[torch.zeros(2, 10, 16, 4, 8)]])
    kv = torch.zeros(2, 10, 16, 4, 8)
    assert DeviceKVView(flash, [[kv[0], kv[1]]]).num_blocks(0) == 10


def test_config_names_the_setting_at_fault_and_none_means_unset_everywhere(caplog):
    with pytest.raises(ValueError, match=r"^lmdb_map_size_bytes must be at most 1 TiB \(1099511627776, the most the map grows to\), "
                                         r"got 1125899906842624$"):
        EngineConfig(lmdb_map_size_bytes=2**50)
    for word in ("none", "None", " NONE "):
        env = {"KVTIER_CACHE_DIR": word, "KVTIER_LMDB_SEGMENT_THRESHOLD_BYTES": word,
               "KVTIER_DISK_INDEX_REFRESH_INTERVAL_S": word, "KVTIER_STORE_RETENTION_INTERVAL_TOKENS": word}
        config = EngineConfig.from_env(env)
        assert (config.cache_dir, config.lmdb_segment_threshold_bytes, config.disk_index_refresh_interval_s,
                config.store_retention_interval_tokens) == (None, None, None, None)
        assert EngineConfig.from_dict({"cache_dir": word}).cache_dir is None
    assert EngineConfig.from_dict({"cache_dir": "./none"}).cache_dir == "./none"

    caplog.set_level(logging.WARNING, logger="kvtier.engine")
    typo = {"KVTIER_CACHEDIR": "/x", "KVTIER_HOST_CAPACITY": "1GiB", "KVTIER_FAULT_SEED": "3"}
    EngineConfig.from_env(typo)
    EngineConfig.from_env(typo)  # once per process, not per read
    assert sorted(r.getMessage() for r in caplog.records) == [
        "environment variable KVTIER_CACHEDIR is not a kvtier setting and is ignored; did you mean KVTIER_CACHE_DIR?",
        "environment variable KVTIER_HOST_CAPACITY is not a kvtier setting and is ignored; did you mean KVTIER_HOST_CAPACITY_BYTES?",
    ]
