"""vLLM's key scheme under the order a real vLLM server builds things in.

``EngineCore`` builds the Scheduler, and with it every secondary tier, before it calls
``init_none_hash``; the tier's keys must come from the seed vLLM hashes requests with, whatever the
process did before. Each server here is a fresh OS process (NONE_HASH is a process global) built
by ``vllm_server_child.py`` in EngineCore's order, on vLLM 0.33's real Scheduler and connector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHILD = str(Path(__file__).with_name("vllm_server_child.py"))


def server(mode: str, cache_dir: Path, hash_algorithm: str = "sha256", **env: str) -> dict:
    proc = subprocess.run([sys.executable, CHILD, mode, str(cache_dir), hash_algorithm], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_server_built_in_engine_core_order_hits_a_cache_warmed_through_vllm(tmp_path):
    """The warmup's process had NONE_HASH seeded before its tier was built; the server's tier is
    built before vLLM seeds it. Both key with the seed vLLM hashes with: the server's first request
    hits all 32 tokens, bitwise."""
    cache = tmp_path / "kv"
    assert server("warm-seeded", cache) == {"stored": 4, "hash_algorithm": "sha256"}
    served = server("serve", cache)
    assert served == {"hit_tokens": 32, "loaded": {"0": [0, 1], "1": [6, 7]}, "bitwise": True,
                      "hash_algorithm": "sha256", "failed": 0}
    assert len(list(cache.glob("vllm-layout-*.json"))) == 1


def test_an_engine_rebuilt_in_one_process_hits_what_the_first_stored_and_writes_one_layout(tmp_path):
    out = server("rebuild", tmp_path / "kv")
    assert out["hit_tokens"] == 32 and out["bitwise"] and out["failed"] == 0
    assert len(out["layout_files"]) == 1


def test_an_xxhash_server_records_xxhash_and_the_offline_warmup_computes_its_keys(tmp_path):
    """With PYTHONHASHSEED set on the server and on `kvtier warmup --key-scheme vllm`, the warmup
    (another process) finds every chunk the server stored under the keys it computes."""
    cache = tmp_path / "kv"
    assert server("warm-seeded", cache, "xxhash", PYTHONHASHSEED="7") == {"stored": 4, "hash_algorithm": "xxhash"}
    (layout_file,) = cache.glob("vllm-layout-*.json")
    assert json.loads(layout_file.read_text())["hash_algorithm"] == "xxhash"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": [(i * 7) % 900 + 3 for i in range(33)]}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "warmup", "--key-scheme", "vllm",
                           "--prompts", str(prompts), "--cache-dir", str(cache)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "7"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["prompt 1: group 0: 2/2 chunks (2 leading), group 1: 2/8 chunks (0 leading)"]
    assert server("serve", cache, "xxhash", PYTHONHASHSEED="7")["hit_tokens"] == 32


def offloading_config(tp_size: int, agnostic: bool):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn.attn",), group_id=0),),
        worker_kv_bytes_per_block=4096 // tp_size, enable_kv_cache_events=False, extra_config={},
        engine_id="e", model=OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=agnostic),
    )


def test_servers_of_two_tp_sizes_share_records_exactly_where_vllm_says_the_bytes_are_the_same():
    """vLLM's ``is_parallelism_agnostic`` says a block's persisted bytes are the same under any
    topology (the primary row the CPU tier hands kvtier is then one row at any TP size): TP=1 and
    TP=2 servers get one fingerprint and one key namespace. Where vLLM says they are not, the
    layouts differ and the tier's start-up line names the parallel sizes and the reason."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.config import VllmTierConfig
    from kvtier.integrations.vllm.tier import layout_from_spec, parallel_sharing_note

    config = VllmTierConfig(cache_dir="/unused")

    def layout(tp, agnostic):
        return layout_from_spec(SimpleNamespace(config=offloading_config(tp, agnostic)), 4096, config)

    shared = [layout(tp, True).with_key_scheme("sha256", b"\x01" * 32) for tp in (1, 2)]
    assert shared[0] == shared[1] and shared[0].namespace == shared[1].namespace
    assert shared[0].worker_kv_bytes_per_block == 4096 and parallel_sharing_note(shared[0]) is None
    bound = [layout(tp, False) for tp in (1, 2)]
    assert bound[0].fingerprint != bound[1].fingerprint
    note = parallel_sharing_note(bound[1])
    assert note.startswith("kvtier: records are bound to this parallel layout (world_size=2, tp_size=2, pp_size=1")
    assert "not parallelism-agnostic" in note and "will not hit them" in note


def test_the_key_scheme_is_the_one_vllm_seeded_whatever_the_config_guessed():
    """The algorithm is read back from vLLM's own NONE_HASH and seed; a config naming another
    algorithm than vLLM hashes with is refused by name (the tier then misses, and says so once)."""
    import pytest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from kvtier.integrations.vllm import VllmTierConfigError
    from kvtier.integrations.vllm.tier import vllm_key_scheme

    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        kv_cache_utils.init_none_hash(get_hash_fn_by_name(name))
        assert vllm_key_scheme(None) == (name, bytes(kv_cache_utils.NONE_HASH))
    with pytest.raises(VllmTierConfigError, match="hash_algorithm is 'sha256' but vLLM hashes prefix blocks with 'xxhash_cbor'"):
        vllm_key_scheme("sha256")
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
