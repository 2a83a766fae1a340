"""kvtier's SGLang HiCache backend driven through SGLang 0.5.23's own storage classes.

The backend is built by SGLang's ``StorageBackendFactory`` ("dynamic"), configured with
``HiCacheStorageConfig``, and called with ``PoolTransfer``s over ``PageHostPool``s (SGLang's host
pool module does not import on a CPU-only machine). Answers are compared with SGLang's
``HiCacheFile`` on generated cases; bytes are compared bitwise.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

hicache = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang 0.5.23 is not installed (pip install --no-deps -r requirements-sglang.txt)")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvtier.integrations.sglang import KvtierHiCacheStorage, SglangStorageConfigError  # noqa: E402
from kvtier.integrations.sglang.testing import PageHostPool  # noqa: E402
from kvtier.tiers.base import IOHook  # noqa: E402
from kvtier.tools.testing.faults import corrupt_stored_record  # noqa: E402

PAGE = 4  # tokens per page
POOL_PAGES = 24
SIDE_POOLS = (PoolName.SWA, PoolName.DRAFT)
LAYOUT_OF = {PoolName.KV: "page_first", PoolName.SWA: "layer_first", PoolName.DRAFT: "page_first_direct"}


def storage_config(extra: Dict, **overrides) -> HiCacheStorageConfig:
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=False, is_page_first_layout=True, model_name="org/tiny-model",
                  extra_config=dict(extra))
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


def kvtier_extra(cache_dir: Path, **more) -> Dict:
    return {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "cache_dir": str(cache_dir), **more}


def make_pools() -> Dict[PoolName, PageHostPool]:
    return {name: PageHostPool(num_pages=POOL_PAGES, page_size=PAGE, layout=layout) for name, layout in LAYOUT_OF.items()}


def attach(backend, pools: Dict[PoolName, PageHostPool]):
    """What SGLang's hybrid controller does after building a backend."""
    backend.register_mem_pool_host(pools[PoolName.KV])
    for name, pool in pools.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def open_kvtier(cache_dir: Path, pools, **extra) -> KvtierHiCacheStorage:
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(kvtier_extra(cache_dir, **extra)), None)
    assert type(backend) is KvtierHiCacheStorage
    return attach(backend, pools)


def slots(first_page: int, count: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + count) * PAGE, dtype=torch.int64)


def fill(pool: PageHostPool, first_page: int, seeds: Sequence[int]) -> List[bytes]:
    return [pool.fill_page((first_page + i) * PAGE, seed) for i, seed in enumerate(seeds)]


def read_back(pool: PageHostPool, first_page: int, count: int) -> List[bytes]:
    return [pool.page_bytes((first_page + i) * PAGE) for i in range(count)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One kvtier backend and one HiCacheFile over the same kind of pools, for the generated cases
    (each case uses hashes of its own)."""
    root = tmp_path_factory.mktemp("sglang")
    pools = make_pools()
    ours = open_kvtier(root / "kvtier", pools)
    ref_pools = make_pools()
    reference = attach(HiCacheFile(storage_config({"file_storage_path": str(root / "file")})), ref_pools)
    yield ours, pools, reference, ref_pools
    ours.close()


def test_factory_builds_it_and_extra_config_errors_name_the_key(tmp_path):
    with pytest.raises(SglangStorageConfigError, match="unknown extra config key 'cache_dri'"):
        StorageBackendFactory.create_backend("dynamic", storage_config(
            {**kvtier_extra(tmp_path), "cache_dri": "/x"}), None)
    bad = kvtier_extra(tmp_path, op_timeout_s=-1)
    with pytest.raises(SglangStorageConfigError, match="'op_timeout_s' must be a finite number of seconds > 0, got -1"):
        StorageBackendFactory.create_backend("dynamic", storage_config(bad), None)
    missing = kvtier_extra(tmp_path)
    del missing["cache_dir"]
    with pytest.raises(SglangStorageConfigError, match="'cache_dir' .* is missing"):
        StorageBackendFactory.create_backend("dynamic", storage_config(missing), None)
    assert not any(tmp_path.iterdir())  # nothing was created before the error


def test_bytes_round_trip_bitwise_through_v0_v1_v2_and_the_cli_tools(tmp_path):
    from kvtier.tools._maintenance import gc_cache, inspect_cache, verify_cache

    pools = make_pools()
    backend = open_kvtier(tmp_path, pools)
    hashes = [f"page-{i}" for i in range(6)]
    kv = fill(pools[PoolName.KV], 0, range(6))
    swa = fill(pools[PoolName.SWA], 0, range(100, 103))
    draft = fill(pools[PoolName.DRAFT], 0, range(200, 206))
    assert backend.batch_set_v1(hashes, slots(0, 6)) == [True] * 6
    stored = backend.batch_set_v2([
        PoolTransfer(name=PoolName.SWA, keys=hashes[3:], host_indices=slots(0, 3), hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=PoolName.DRAFT, keys=hashes, host_indices=slots(0, 6)),
    ])
    assert stored == {PoolName.SWA: [True] * 3, PoolName.DRAFT: [True] * 6}
    v0_value = torch.arange(256, dtype=torch.bfloat16)
    assert backend.set("v0-page", v0_value[::1])  # a view: stored from a private copy

    fresh = make_pools()  # another process's pools, the pages at other host slots
    backend.registered_pools.update(fresh)
    backend.mem_pool_host = fresh[PoolName.KV]
    assert backend.batch_get_v1(hashes, slots(10, 6)) == [True] * 6
    loaded = backend.batch_get_v2([
        PoolTransfer(name=PoolName.SWA, keys=hashes[3:], host_indices=slots(5, 3), hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=PoolName.DRAFT, keys=hashes, host_indices=slots(12, 6)),
    ])
    assert loaded == {PoolName.SWA: [True] * 3, PoolName.DRAFT: [True] * 6}
    assert read_back(fresh[PoolName.KV], 10, 6) == kv
    assert read_back(fresh[PoolName.SWA], 5, 3) == swa
    assert read_back(fresh[PoolName.DRAFT], 12, 6) == draft
    out = torch.zeros(256, dtype=torch.bfloat16)
    assert backend.get("v0-page", out) is out and torch.equal(out.view(torch.int16), v0_value.view(torch.int16))
    assert backend.batch_exists(hashes + ["absent"]) == 6 and not backend.exists("absent")
    stats = backend.statistics()
    backend.close()

    report = inspect_cache(str(tmp_path))
    assert report.records == 6 + 3 + 6 + 1 == stats["records"]
    assert sorted((g, r.records) for g, r in report.groups.items()) == sorted(
        [(list(PoolName).index(PoolName.KV), 7), (list(PoolName).index(PoolName.SWA), 3),
         (list(PoolName).index(PoolName.DRAFT), 6)])
    verified = verify_cache(str(tmp_path))
    assert (verified.checked, verified.ok) == (16, 16)
    assert gc_cache(str(tmp_path), max_bytes=0)["evicted_records"] == 16
    # The directory gc leaves opens again as the healthy, empty cache it is (its last allocated
    # page lies past the end of data.mdb: allocated, freed, never written).
    assert inspect_cache(str(tmp_path)).records == 0


def test_a_second_host_restores_from_the_remote_tier_what_the_first_stored(tmp_path, valkey_node):
    # Two hosts, each with its own cache directory, one Valkey behind both: the store layer's
    # remote chain under the backend (write-through, read-through, promoted to the local disk).
    pools_a, pools_b = make_pools(), make_pools()
    extra = dict(remote_url=valkey_node.url, remote_namespace=f"sglang-{tmp_path.name}")
    first = open_kvtier(tmp_path / "a", pools_a, **extra)
    kv = fill(pools_a[PoolName.KV], 0, range(300, 304))
    hashes = [f"shared-{i}" for i in range(4)]
    assert first.batch_set_v1(hashes, slots(0, 4)) == [True] * 4
    first.close()
    second = open_kvtier(tmp_path / "b", pools_b, **extra)
    try:
        assert second.batch_exists(hashes) == 4
        assert second.batch_get_v1(hashes, slots(4, 4)) == [True] * 4
        assert read_back(pools_b[PoolName.KV], 4, 4) == kv
    finally:
        second.close()
    # The read promoted the pages into the second host's own directory.
    from kvtier.tools._maintenance import inspect_cache

    assert inspect_cache(str(tmp_path / "b")).records == 4


def test_keys_bind_model_rank_salt_and_pool_layout(tmp_path):
    pools = make_pools()
    backend = open_kvtier(tmp_path / "a", pools)
    fill(pools[PoolName.KV], 0, [7])
    assert backend.batch_set_v1(["h"], slots(0, 1)) == [True]
    backend.close()
    variants = [dict(), dict(model_name="org/other-model"), dict(tp_rank=1, tp_size=2)]
    found = []
    for overrides in variants:
        b = attach(KvtierHiCacheStorage(storage_config(kvtier_extra(tmp_path / "a"), **overrides)), make_pools())
        found.append(b.exists("h"))
        b.close()
    for extra in (dict(tenant_salt="tenant-b"), dict(weights_version="v2")):
        b = attach(KvtierHiCacheStorage(storage_config(kvtier_extra(tmp_path / "a", **extra))), make_pools())
        found.append(b.exists("h"))
        b.close()
    other_layout = make_pools()
    other_layout[PoolName.KV] = PageHostPool(num_pages=POOL_PAGES, page_size=PAGE, layout="layer_first")
    b = attach(KvtierHiCacheStorage(storage_config(kvtier_extra(tmp_path / "a"))), other_layout)
    found.append(b.exists("h"))
    b.close()
    assert found == [True, False, False, False, False, False]


POLICIES = st.sampled_from([PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES])
_case_ids = itertools.count()


@st.composite
def cases(draw):
    n = draw(st.integers(1, 8))
    kv = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    pools = []
    for name in draw(st.lists(st.sampled_from(SIDE_POOLS), unique=True, max_size=2)):
        present = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        pools.append((name, draw(POLICIES), draw(st.integers(1, 3)), present))
    stored = [(PoolName.KV, i) for i in range(n) if kv[i]] + [(name, i) for name, _, _, p in pools for i in range(n) if p[i]]
    corrupt = draw(st.lists(st.sampled_from(stored), unique=True, max_size=3)) if stored else []
    return n, kv, pools, corrupt


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_exists_v2_and_get_v2_answer_as_hicache_file_does(shared, case):
    """Generated pools, page counts, hit policies, missing and corrupt pages: kvtier's answers are
    HiCacheFile's on the pages that can be read (a corrupt record is a miss from its first read on;
    HiCacheFile cannot tell a corrupt file, so its reference is the case without those pages)."""
    ours, pools, reference, ref_pools = shared
    n, kv, side, corrupt = case
    case_id = next(_case_ids)
    hashes = [f"case{case_id}-page{i}" for i in range(n)]
    for backend, host in ((ours, pools), (reference, ref_pools)):
        seeds = [case_id * 100 + i for i in range(n)]
        fill(host[PoolName.KV], 0, seeds)
        for name, present in ((PoolName.KV, kv), *((name, present) for name, _, _, present in side)):
            if name != PoolName.KV:
                fill(host[name], 0, [s + 7 for s in seeds])
            keep = [i for i in range(n) if present[i]]
            if keep:
                backend.batch_set_v2([PoolTransfer(name=name, keys=[hashes[i] for i in keep],
                                                   host_indices=torch.cat([slots(i, 1) for i in keep]))])
    for name, index in corrupt:
        key = ours._page_keys(name)[1].page_key(hashes[index])
        corrupt_stored_record(ours._tier, key)
        suffix = "" if name == PoolName.KV else f".{name}"
        os.remove(Path(reference.file_path) / f"{hashes[index]}{suffix}{reference.config_suffix}.bin")

    every = [PoolTransfer(name=name, keys=hashes, host_indices=slots(n, n)) for name in (PoolName.KV, *SIDE_POOLS)]
    got = ours.batch_get_v2(every)
    want = reference.batch_get_v2(every)
    assert got == want
    for name in (PoolName.KV, *SIDE_POOLS):
        loaded = [i for i, ok in enumerate(got[name]) if ok]
        assert [pools[name].page_bytes((n + i) * PAGE) for i in loaded] == \
               [ref_pools[name].page_bytes((n + i) * PAGE) for i in loaded]

    transfers = [PoolTransfer(name=name, keys=["placeholder"] * trailing, hit_policy=policy)
                 for name, policy, trailing, _ in side]
    ours_result = ours.batch_exists_v2(hashes, transfers)
    assert ours_result == reference.batch_exists_v2(hashes, transfers)
    # Every restorable length loads: its KV prefix and each pool's window.
    for length in ours_result.restorable_prefix_pages:
        window = [PoolTransfer(name=PoolName.KV, keys=hashes[:length], host_indices=slots(n, length))]
        for name, policy, trailing, _ in side:
            start = max(0, length - trailing) if policy == PoolHitPolicy.TRAILING_PAGES else 0
            window.append(PoolTransfer(name=name, keys=hashes[start:length], host_indices=slots(n, length - start)))
        assert all(all(oks) for oks in ours.batch_get_v2(window).values())


class _SlowDisk(IOHook):
    """A disk whose operations of one kind take ``delay_s`` (on the tier's own threads)."""

    def __init__(self, op: str, delay_s: float) -> None:
        self.op, self.delay_s = op, delay_s

    def before(self, op: str) -> None:
        if op == self.op:
            time.sleep(self.delay_s)


def test_a_slow_disk_never_blocks_past_the_bound_nor_touches_the_host_pool_late(tmp_path):
    pools = make_pools()
    backend = open_kvtier(tmp_path, pools, op_timeout_s=0.15)
    kv = pools[PoolName.KV]
    original = fill(kv, 0, [1, 2])
    assert backend.batch_set_v1(["a", "b"], slots(0, 2)) == [True, True]

    backend._tier._io_hook = _SlowDisk("read", 0.8)
    scribble = fill(kv, 4, [9, 9])
    started = time.monotonic()
    assert backend.batch_get_v1(["a", "b"], slots(4, 2)) == [False, False]
    assert time.monotonic() - started < 0.6
    time.sleep(0.9)  # the read has finished in the background, into pages of its own
    assert read_back(kv, 4, 2) == scribble

    backend._tier._io_hook = _SlowDisk("commit", 0.8)
    before = fill(kv, 2, [3])
    started = time.monotonic()
    assert backend.batch_set_v1(["c"], slots(2, 1)) == [False]
    assert time.monotonic() - started < 0.6
    fill(kv, 2, [4])  # SGLang reuses the slot at once
    backend._tier._io_hook = IOHook()
    time.sleep(0.9)
    assert backend.batch_get_v1(["c", "a"], slots(6, 2)) == [True, True]  # the late write landed, with the bytes it was given
    assert read_back(kv, 6, 2) == before + original[:1]
    assert backend.statistics()["sglang_load_timeouts"] == 1 and backend.statistics()["sglang_store_timeouts"] == 1
    backend.close()


def _writer_child(cache_dir: str, acks) -> None:
    """Write batches through batch_set_v2 forever; after each acknowledged one, say its number."""
    pools = make_pools()
    backend = open_kvtier(Path(cache_dir), pools, lmdb_verify_on_open=False)
    for batch in itertools.count():
        hashes = [f"b{batch}-p{i}" for i in range(4)]
        fill(pools[PoolName.KV], 0, [batch * 10 + i for i in range(4)])
        fill(pools[PoolName.SWA], 0, [batch * 10 + i + 5 for i in range(2)])
        result = backend.batch_set_v2([
            PoolTransfer(name=PoolName.KV, keys=hashes, host_indices=slots(0, 4)),
            PoolTransfer(name=PoolName.SWA, keys=hashes[2:], host_indices=slots(0, 2), hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ])
        if all(all(oks) for oks in result.values()):
            acks.send(batch)


def test_kill_9_during_batch_set_v2_loses_no_acknowledged_page(tmp_path):
    context = multiprocessing.get_context("fork")  # the child inherits SGLang's import (seconds on 2 cores)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_writer_child, args=(str(tmp_path), send), daemon=True)
    child.start()
    acked = []
    deadline = time.monotonic() + 60
    while len(acked) < 6 and time.monotonic() < deadline:
        if receive.poll(0.1):
            acked.append(receive.recv())
    time.sleep(0.013)  # the kill lands inside a later batch (one batch takes a few ms here)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    while receive.poll():
        acked.append(receive.recv())
    assert child.exitcode == -signal.SIGKILL and len(acked) >= 6

    pools = make_pools()
    backend = open_kvtier(tmp_path, pools)
    for batch in acked:
        hashes = [f"b{batch}-p{i}" for i in range(4)]
        result = backend.batch_exists_v2(hashes, [PoolTransfer(name=PoolName.SWA, keys=["x"] * 2,
                                                               hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert result.kv_hit_pages == 4 and result.restorable_prefix_pages[-1] == 4
        loaded = backend.batch_get_v2([
            PoolTransfer(name=PoolName.KV, keys=hashes, host_indices=slots(0, 4)),
            PoolTransfer(name=PoolName.SWA, keys=hashes[2:], host_indices=slots(0, 2)),
        ])
        assert loaded == {PoolName.KV: [True] * 4, PoolName.SWA: [True] * 2}
        expect = make_pools()
        assert read_back(pools[PoolName.KV], 0, 4) == fill(expect[PoolName.KV], 0, [batch * 10 + i for i in range(4)])
        assert read_back(pools[PoolName.SWA], 0, 2) == fill(expect[PoolName.SWA], 0, [batch * 10 + i + 5 for i in range(2)])
    assert backend._loop.run(backend._tier.check(), 30) == []
    backend.close()


def test_failure_injector_around_the_backend_leaves_it_consistent(tmp_path, monkeypatch):
    """SGLang's own fault proxy (what its factory wraps a backend in when its test variables are
    set) fails a third of the calls: what it let through and acknowledged is stored and loads
    bitwise; the backend underneath agrees with HiCacheFile fed the same acknowledged pages."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.35")
    injected = StorageBackendFactory.create_backend("dynamic", storage_config(kvtier_extra(tmp_path / "kvtier")), None)
    assert type(injected) is HiCacheStorageFailureInjector
    backend = injected._backend
    assert type(backend) is KvtierHiCacheStorage
    pools = make_pools()
    attach(injected, pools)
    injected._thread_local_random().seed(1234)
    ref_pools = make_pools()
    reference = attach(HiCacheFile(storage_config({"file_storage_path": str(tmp_path / "file")})), ref_pools)
    expected: Dict[str, bytes] = {}
    for step in range(30):
        hashes = [f"s{step}-p{i}" for i in range(3)]
        data = fill(pools[PoolName.KV], 0, [step * 3 + i for i in range(3)])
        fill(ref_pools[PoolName.KV], 0, [step * 3 + i for i in range(3)])
        acked = injected.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=hashes, host_indices=slots(0, 3))])[PoolName.KV]
        for page_hash, page, ok in zip(hashes, data, acked):
            if ok:
                expected[page_hash] = page
        if all(acked):
            assert reference.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=hashes,
                                                        host_indices=slots(0, 3))])[PoolName.KV] == [True] * 3
        got = injected.batch_get_v1(hashes, slots(3, 3))
        assert all(not ok or read_back(pools[PoolName.KV], 3 + i, 1)[0] == expected[hashes[i]]
                   for i, ok in enumerate(got))
        answer = injected.batch_exists_v2(hashes, [])
        assert answer in (PoolTransferResult.empty(), backend.batch_exists_v2(hashes, []))
    assert 0 < len(expected) < 90
    for step in range(30):
        hashes = [f"s{step}-p{i}" for i in range(3)]
        assert backend.batch_exists_v2(hashes, []) == reference.batch_exists_v2(hashes, [])
        acked = [h for h in hashes if h in expected]
        assert backend.batch_get_v1(acked, slots(0, len(acked))) == [True] * len(acked)
        assert read_back(pools[PoolName.KV], 0, len(acked)) == [expected[h] for h in acked]
    everything = list(expected)
    assert backend._loop.run(backend._tier.check(), 30) == []
    injected.close()
    assert backend.batch_exists(everything) == 0  # closed: a miss, never an exception


def test_logical_anchor_odd_calls_and_concurrent_threads_answer_without_raising(tmp_path):
    """DeepSeek-V4's logical KV anchor holds no bytes: v1 succeeds, the side pools gate the hit.
    Calls SGLang's file backend fails (an unregistered pool, indices that do not match the keys, a
    BLOCK_GROUPS pool) fail the same way here, without an exception. Threads calling at once (the
    prefetch and backup threads) each get their own answers."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtier.integrations.sglang.testing import LogicalAnchorPool

    c4 = PageHostPool(num_pages=POOL_PAGES, page_size=PAGE, layout="page_first")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(kvtier_extra(tmp_path)), None)
    anchor = LogicalAnchorPool(num_pages=POOL_PAGES, page_size=PAGE)
    attach(backend, {PoolName.KV: anchor, PoolName.DEEPSEEK_V4_C4: c4})
    hashes = [f"v4-{i}" for i in range(4)]
    assert backend.batch_set_v1(hashes, slots(0, 4)) == [True] * 4
    data = fill(c4, 0, range(3))
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=hashes[:3], host_indices=slots(0, 3))]) \
        == {PoolName.DEEPSEEK_V4_C4: [True] * 3}
    result = backend.batch_exists_v2(hashes, [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=hashes)])
    assert result == PoolTransferResult(3, {PoolName.KV: 4, PoolName.DEEPSEEK_V4_C4: 3}, [1, 2, 3])
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=hashes[:3], host_indices=slots(8, 3))]) \
        == {PoolName.DEEPSEEK_V4_C4: [True] * 3} and read_back(c4, 8, 3) == data

    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=hashes, host_indices=slots(0, 4)),
                                 PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=hashes, host_indices=slots(0, 3))]) \
        == {PoolName.MAMBA: [False] * 4, PoolName.DEEPSEEK_V4_C4: [False] * 4}
    blocks = PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=hashes, hit_policy=PoolHitPolicy.BLOCK_GROUPS, group_pages=2)
    assert backend.batch_exists_v2(hashes, [blocks]) == PoolTransferResult(
        4, {PoolName.KV: 4, PoolName.DEEPSEEK_V4_C4: 2}, [1, 2, 3, 4])

    def worker(n: int) -> bool:
        keys = [f"thread{n}-{i}" for i in range(3)]
        stored = backend.batch_set_v2([PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=keys,
                                                    host_indices=slots(0, 3))])[PoolName.DEEPSEEK_V4_C4]
        found = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=keys)])
        return stored == [True] * 3 and found.kv_hit_pages == 3

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(worker, range(8))) == [True] * 8
    backend.close()


def test_disk_errors_are_misses_and_failed_stores_until_the_disk_heals(tmp_path):
    from kvtier.tools.testing.faults import inject_io_faults, remove_io_faults

    pools = make_pools()
    backend = open_kvtier(tmp_path, pools)
    kv = pools[PoolName.KV]
    first = fill(kv, 0, [1])
    assert backend.batch_set_v1(["old"], slots(0, 1)) == [True]
    inject_io_faults(backend._tier, fail_from=1, ops=["commit"])
    fill(kv, 1, [2])
    assert backend.batch_set_v1(["new"], slots(1, 1)) == [False]
    assert backend.batch_get_v1(["old"], slots(2, 1)) == [True] and read_back(kv, 2, 1) == first
    inject_io_faults(backend._tier, fail_from=1, ops=["read"])
    assert backend.batch_exists(["old"]) == 0 and backend.batch_get_v1(["old"], slots(3, 1)) == [False]
    assert backend.batch_exists_v2(["old"], []) == PoolTransferResult(0, {}, [])
    remove_io_faults(backend._tier)
    assert backend.batch_set_v1(["new"], slots(1, 1)) == [True]
    assert backend.batch_exists(["old", "new"]) == 2
    stats = backend.statistics()
    assert stats["sglang_store_failures"] == 1 and stats["sglang_load_failures"] == 1
    backend.close()
