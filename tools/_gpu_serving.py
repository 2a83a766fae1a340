"""The serving engines' end-to-end GPU checks of ``kvtier.tools.gpu_check``: a real ``vllm.LLM``
with ``KvtierTier`` under its CPU tier, and a real ``sglang.Engine`` with kvtier as its HiCache L3
storage backend. Each builds a tiny model from a config with dummy weights, sends one prompt, drops
the engine's own caches, sends it again, and checks that the second answer came from kvtier (cached
tokens, records on disk) and is the same greedy output. Blocking; run from the check script's
thread. They raise ``CheckFailed`` (from ``gpu_check``) through the ``require`` callable given.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

__all__ = ["check_vllm", "check_sglang", "count_records"]

Require = Callable[[bool, str], None]

_PROMPT = [(i * 37) % 900 + 5 for i in range(300)]
# The calls SGLang's storage backends make on the host pool they are registered with; kvtier's CPU
# test pool (integrations/sglang/testing.py) implements exactly these.
_HOST_POOL_CALLS = ("get_size_per_token", "get_ksize_per_token", "get_data_page", "get_dummy_flat_data_page",
                    "set_from_flat_data_page", "get_page_buffer_meta")


def count_records(directory: Path, require: Require) -> int:
    """Records in the LMDB cache at ``directory``, counted in a child process: LMDB forbids opening
    one environment twice in a process, and the serving engine may hold it in this one."""
    script = ("import asyncio, sys\nfrom kvtier.tiers.lmdb import LmdbTier\nasync def main():\n"
              "    tier = await LmdbTier.open(sys.argv[1], readonly=True)\n"
              "    print(len((await tier.snapshot_keys()).keys))\n"
              "    await tier.close()\nasyncio.run(main())\n")
    child = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True, timeout=120)
    require(child.returncode == 0, f"counting records in {directory} failed: {child.stderr.strip()[-500:]}")
    return int(child.stdout.split()[-1])


def check_vllm(cache_dir: Path, require: Require) -> str:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.testing import write_model_config

    model_dir = write_model_config(cache_dir / "model", num_layers=4, sliding_window=64)
    kv_dir = cache_dir / "vllm-kv"
    tier = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "cache_dir": str(kv_dir)}
    llm = LLM(
        model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
        max_model_len=1024, gpu_memory_utilization=0.3, enforce_eager=True, seed=0,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 << 20,
                                          "secondary_tiers": [tier]},
        },
    )
    # vLLM marks TokensPrompt's other keys typing.NotRequired (3.11+), which a check at 3.10 cannot read.
    prompt = TokensPrompt(prompt_token_ids=_PROMPT)  # type: ignore[typeddict-item]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    require(llm.reset_prefix_cache(reset_connector=True), "vLLM refused to reset its prefix cache")
    second = llm.generate([prompt], params)[0]
    cached = int(second.num_cached_tokens or 0)
    count = count_records(kv_dir, require)
    require(cached >= 256 and count > 0, f"second request: {cached} cached tokens; {count} records in {kv_dir}")
    same = list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids)
    return f"second request served {cached}/300 prompt tokens from cache; {count} records on disk; tokens same: {same}"


def _host_pool_matches_sglangs(require: Require) -> None:
    """kvtier's CPU test pool answers the calls SGLang's backends make with SGLang's own parameter
    names and order (the real class imports only where SGLang's GPU stack does)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from kvtier.integrations.sglang.testing import PageHostPool

    for name in _HOST_POOL_CALLS:
        real = getattr(MHATokenToKVPoolHost, name, None)
        if real is None:
            require(False, f"SGLang's MHATokenToKVPoolHost has no {name}: the test pool models a call it lacks")
            continue
        theirs: List[str] = list(inspect.signature(real).parameters)
        ours: List[str] = list(inspect.signature(getattr(PageHostPool, name)).parameters)
        require(ours == theirs[: len(ours)], f"{name}: the test pool takes {ours}, SGLang's pool {theirs}")


def _write_llama_config(directory: Path) -> Path:
    """A tiny Llama config (no weights: SGLang loads dummy ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    }))
    return directory


def check_sglang(cache_dir: Path, require: Require) -> str:
    import sglang

    _host_pool_matches_sglangs(require)
    kv_dir = cache_dir / "sglang-kv"
    extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
             "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "cache_dir": str(kv_dir)}
    engine = sglang.Engine(
        model_path=str(_write_llama_config(cache_dir / "sglang-model")), load_format="dummy",
        skip_tokenizer_init=True, dtype="bfloat16", mem_fraction_static=0.3, disable_cuda_graph=True,
        page_size=16, random_seed=0, log_level="error",
        enable_hierarchical_cache=True, hicache_ratio=2, hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra), hicache_storage_prefetch_policy="wait_complete",
    )
    try:
        params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
        first = engine.generate(input_ids=_PROMPT, sampling_params=params)
        # The host pool backs pages up to kvtier in the background: wait (bounded) until they land.
        deadline = time.monotonic() + 60
        count = count_records(kv_dir, require) if kv_dir.exists() else 0
        while count == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            count = count_records(kv_dir, require) if kv_dir.exists() else 0
        require(count > 0, f"no page reached kvtier's cache at {kv_dir} within 60 s of the first request")
        flushed = engine.flush_cache()
        require(getattr(flushed, "success", True) is not False, "SGLang refused to flush its caches")
        second = engine.generate(input_ids=_PROMPT, sampling_params=params)
    finally:
        engine.shutdown()
    cached = int(second["meta_info"].get("cached_tokens") or 0)
    require(cached >= 256, f"second request: {cached} cached tokens after the flush; {count} records in {kv_dir}")
    require(first["output_ids"] == second["output_ids"],
            f"greedy outputs differ with the prefix restored from kvtier: {first['output_ids']} vs {second['output_ids']}")
    return f"second request served {cached}/300 prompt tokens from kvtier after a flush; {count} records; same tokens"
