"""The SGLang backend's pure parts (no SGLang import): extra-config validation, key binding, and
``batch_exists_v2``'s fold against a brute-force model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import KvtierError
from kvtier.integrations.sglang.config import SglangStorageConfig, SglangStorageConfigError
from kvtier.integrations.sglang.hits import ALL_PAGES, BLOCK_GROUPS, TRAILING_PAGES, PoolQuery, restorable_prefixes
from kvtier.integrations.sglang.keys import PageKeys, PoolBinding


def test_pure_modules_do_not_import_sglang():
    code = ("import sys, kvtier.integrations.sglang as s, kvtier.integrations.sglang.hits, "
            "kvtier.integrations.sglang.keys; s.SglangStorageConfig; print('sglang' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip() == "False"


@pytest.mark.parametrize("key, value, message", [
    ("cache_dir", "", "'cache_dir' must be a non-empty path string, got ''"),
    ("disk_capacity_bytes", 0, "'disk_capacity_bytes' must be a positive int or null, got 0"),
    ("compression", 23, "'compression' must be an int in 0..22"),
    ("op_timeout_s", float("inf"), "'op_timeout_s' must be a finite number of seconds > 0, got inf"),
    ("tenant_salt", "", "'tenant_salt' must be a non-empty string or null"),
    ("read_workers", True, "'read_workers' must be an int >= 1, got True"),
    ("lmdb_segment_threshold_bytes", -1, "'lmdb_segment_threshold_bytes' must be an int >= 0 or null"),
    ("lmdb_segment_compaction_live_fraction", 1.0, "'lmdb_segment_compaction_live_fraction' must be a number in"),
    ("lmdb_verify_on_open", 1, "'lmdb_verify_on_open' must be a bool, got 1"),
    ("eviction_policy", "fifo", "'eviction_policy' must be one of"),
    ("remote_url", "http://127.0.0.1:6379", "'remote_url': remote_url is invalid"),
    ("remote_namespace", "a b", "'remote_namespace': remote_namespace must match"),
])
def test_each_bad_value_is_one_typed_error_naming_its_key(key, value, message):
    extra = {"cache_dir": "/tmp/x", key: value}
    with pytest.raises(SglangStorageConfigError) as caught:
        SglangStorageConfig.from_extra_config(extra)
    assert message in str(caught.value)
    assert isinstance(caught.value, KvtierError) and isinstance(caught.value, ValueError)


def test_sglang_keys_pass_unknown_keys_do_not():
    config = SglangStorageConfig.from_extra_config({
        "backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "cache_dir": "/nvme/kvtier", "compression": 0})
    assert (config.cache_dir, config.compression) == ("/nvme/kvtier", 0)
    with pytest.raises(SglangStorageConfigError, match="unknown extra config key 'compresion'"):
        SglangStorageConfig.from_extra_config({"cache_dir": "/x", "compresion": 1})
    with pytest.raises(SglangStorageConfigError, match="'cache_dir' .* is missing"):
        SglangStorageConfig.from_extra_config(None)


BINDING = PoolBinding(model="m", weights_version="", pool="kv", pool_class="MHATokenToKVPoolHost", layout="page_first",
                      dtype="torch.bfloat16", page_size=64, page_numel=1 << 20, page_bytes=2 << 20, format_tag=None,
                      shard="tp0/1")


def test_every_binding_fact_and_the_salt_change_the_key():
    base = PageKeys(BINDING, None).page_key("abc")
    assert PageKeys(BINDING, None).page_key("abc") == base and len(base) == 32
    changed = {"model": "m2", "weights_version": "v2", "pool": "swa", "pool_class": "MLATokenToKVPoolHost",
               "layout": "layer_first", "dtype": "torch.float16", "page_size": 32, "page_numel": 1, "page_bytes": 2,
               "format_tag": "mxfp8", "shard": "tp1/2"}
    keys = {PageKeys(dataclasses.replace(BINDING, **{name: value}), None).page_key("abc")
            for name, value in changed.items()}
    keys |= {PageKeys(BINDING, "tenant-a").page_key("abc"), PageKeys(BINDING, None).page_key("abd")}
    assert len(keys) == len(changed) + 2 and base not in keys


def brute_force(kv_pages, pools):
    """SGLang's HiCacheFile fold, written out."""
    hits = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for pool in pools:
        if not restorable:
            break
        if pool.policy == ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not pool.present[i]), kv_pages)
            allowed = set(range(1, boundary + 1))
        else:
            allowed = {p for p in range(1, kv_pages + 1)
                       if all(pool.present[i] for i in range(max(0, p - pool.trailing), p))}
            boundary = max(allowed, default=0)
        if boundary:
            hits[pool.name] = boundary
        restorable = [p for p in restorable if p in allowed]
    return (restorable[-1] if restorable else 0), hits, restorable


@st.composite
def queries(draw):
    n = draw(st.integers(0, 12))
    kv_pages = draw(st.integers(0, n))
    pools = [PoolQuery(f"pool{i}", draw(st.sampled_from([ALL_PAGES, TRAILING_PAGES])),
                       draw(st.lists(st.booleans(), min_size=n, max_size=n)), draw(st.integers(1, 5)))
             for i in range(draw(st.integers(0, 3)))]
    return kv_pages, pools


@settings(max_examples=300, deadline=None)
@given(queries())
def test_fold_matches_the_brute_force_model(query):
    kv_pages, pools = query
    assert restorable_prefixes(kv_pages, pools) == brute_force(kv_pages, pools)


def test_block_groups_report_whole_groups_and_never_gate():
    pools = [PoolQuery("c4", BLOCK_GROUPS, [True] * 7 + [False], group_pages=3)]
    assert restorable_prefixes(5, pools) == (5, {"kv": 5, "c4": 6}, [1, 2, 3, 4, 5])


def test_the_backend_opens_the_store_the_engine_would_with_these_settings():
    from kvtier.engine import EngineConfig

    config = SglangStorageConfig.from_extra_config({"cache_dir": "/tmp/x", "compression": 0, "read_workers": 2,
                                                    "remote_url": "redis://127.0.0.1:6379"})
    store = config.store_config()
    assert (store.cache_dir, store.compression_enabled, store.read_workers, store.remote_url,
            store.remote_namespace) == ("/tmp/x", False, 2, "redis://127.0.0.1:6379", "sglang")
    # What the backend does not set keeps the engine's default (the safety switches among them).
    unset = set(store.field_names()) - {"cache_dir", "disk_capacity_bytes", "compression_level", "compression_enabled",
                                        "read_workers", "lmdb_segment_threshold_bytes", "remote_url",
                                        "lmdb_segment_compaction_live_fraction", "lmdb_verify_on_open",
                                        "quarantine_corrupt_cache_dir", "eviction_policy", "remote_namespace"}
    engine = EngineConfig()
    assert {name: getattr(store, name) for name in unset} == {name: getattr(engine, name) for name in unset}
    assert store.lmdb_verify_on_open and store.quarantine_corrupt_cache_dir
