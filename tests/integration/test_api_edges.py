"""The public API on bad input (issue 11): each mistake is a typed error naming the argument and the
value, raised before anything is scheduled; integer-like values that are exact (numpy and torch
integer scalars and arrays) work; settings that can never work are refused where they are known,
and drops that follow from tight settings are logged (rate-limited) and counted."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.engine.drop_log import DropLog
from kvtier.policy import AttentionGroup, DeviceError, ModelLayout
from kvtier.tiers.device import DeviceKVView
from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT as LAYOUT
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

FINGERPRINT = b"api-edges"


async def started(config: EngineConfig = None) -> OffloadEngine:
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config or EngineConfig(host_capacity_bytes=4 << 20, pressure_poll_interval_s=3600.0),
                           fingerprint=FINGERPRINT)
    await engine.start()
    return engine


def nothing_scheduled(engine: OffloadEngine) -> bool:
    return engine.statistics()["chunks_by_state"] == {"pending": 0, "ready": 0, "loading": 0}


@pytest.mark.asyncio
async def test_bad_token_ids_and_counts_are_typed_errors_naming_the_argument():
    engine = await started()
    try:
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
    finally:
        await engine.close()


@pytest.mark.asyncio
async def test_block_ids_must_be_integers_distinct_and_nested():
    engine = await started()
    try:
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
    finally:
        await engine.close()


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
    engine = await started(EngineConfig(store_queue_max_chunks=2, host_capacity_bytes=4 << 20, pressure_poll_interval_s=3600.0))
    try:
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
    finally:
        await engine.close()
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
