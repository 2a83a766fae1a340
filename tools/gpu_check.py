"""One short script for the CUDA paths the CPU test suite cannot reach; run it on a GPU machine.

    python -m kvtier.tools.gpu_check [--cache-dir DIR] [--skip-vllm]

Checks, each reported PASS / FAIL with the reason:
1. ``nvml``: kvtier's NVML pressure source reads device 0's memory fraction (not "unknown").
2. ``engine``: kvtier's own engine on CUDA KV tensors (``device_kind="cuda"``: pinned host slab,
   a copy stream per direction, events): a producer stores the seed prompt, a consumer loads it
   back from host and, after a restart, from disk; every restored byte is compared (the demo's
   ``OffloadScenario``).
3. ``vllm``: a real ``vllm.LLM`` on a tiny hybrid (full + sliding attention) Gemma-3 built from a
   config with dummy weights, ``KvtierTier`` as the secondary tier under vLLM's CPU tier: generate
   greedily, drop vLLM's GPU and CPU caches (``reset_prefix_cache``), generate again: the second
   run must restore its prefix from kvtier (its loads counted) and produce the same tokens.

On a machine without CUDA it runs nothing and exits 3 with one line saying so (the CPU suite,
tests/integration/test_vllm_tier.py, covers everything else). Exit 0: all PASS; 1: a FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, List, Tuple

EXIT_NO_GPU = 3


def check_nvml() -> str:
    from kvtier.engine.pressure import nvml_device_memory_source

    source = nvml_device_memory_source(0)
    fraction = source()
    if fraction is None:
        raise RuntimeError(f"NVML gave no reading: {source.unknown_reason}")
    return f"device 0 memory used {fraction:.1%}"


def check_engine(cache_dir: Path) -> str:
    import torch

    from kvtier.engine import EngineConfig, OffloadEngine
    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tiers.device import DeviceKVView
    from kvtier.tools.testing.scenario import OffloadScenario

    layout = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8, extra_retained_tokens=3)))
    caches = [[torch.zeros(256, 2, g.block_size, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
              for g in layout.groups]
    config = EngineConfig(cache_dir=str(cache_dir / "engine"), host_capacity_bytes=64 << 20, device_kind="cuda")

    async def run() -> int:
        async with OffloadEngine(layout, DeviceKVView(layout, caches), config, fingerprint=b"gpu-check") as engine:
            scenario = OffloadScenario(engine)
            prompt = scenario.tokens(33)
            await scenario.produce(prompt, expect_stored={0: {0, 1}, 1: {1, 2, 3, 5, 6, 7}})
            await scenario.consume(prompt + [5], expect_hit=32)
            produced = scenario.producer_bytes
        async with OffloadEngine(layout, DeviceKVView(layout, caches), config, fingerprint=b"gpu-check") as engine:
            scenario = OffloadScenario(engine)
            scenario.producer_bytes = produced
            await scenario.consume(prompt + [5], expect_hit=32)
        return len(produced)

    blocks = asyncio.run(run())
    return f"{blocks} producer blocks restored bitwise from host and, after a restart, from disk"


def check_vllm(cache_dir: Path) -> str:
    from vllm import LLM, SamplingParams

    from kvtier.integrations.vllm.testing import write_model_config

    model_dir = write_model_config(cache_dir / "model", num_layers=4, sliding_window=64)
    tier = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "cache_dir": str(cache_dir / "vllm-kv")}
    llm = LLM(
        model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
        max_model_len=1024, gpu_memory_utilization=0.3, enforce_eager=True, seed=0,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 << 20,
                                          "secondary_tiers": [tier]},
        },
    )
    prompt = {"prompt_token_ids": [(i * 37) % 900 + 5 for i in range(300)]}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    if not llm.reset_prefix_cache(reset_connector=True):
        raise RuntimeError("vLLM refused to reset its prefix cache")
    second = llm.generate([prompt], params)[0].outputs[0].token_ids
    if list(first) != list(second):
        raise RuntimeError(f"outputs differ with a restored prefix: {list(first)} vs {list(second)}")
    stats_files = sorted((cache_dir / "vllm-kv").glob("vllm-layout-*.json"))
    return f"same 16 greedy tokens with and without the restored prefix; layout file {stats_files[0].name if stats_files else 'missing'}"


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", help="directory for the checks' caches (default: a temporary one)")
    parser.add_argument("--skip-vllm", action="store_true", help="only kvtier's own CUDA paths")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, cuda available: False): "
              "nothing was run; run this on a GPU machine", file=sys.stderr)
        return EXIT_NO_GPU
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="kvtier-gpu-check-"))
    checks: List[Tuple[str, Callable[[], str]]] = [("nvml", check_nvml), ("engine", lambda: check_engine(cache_dir))]
    if not args.skip_vllm:
        checks.append(("vllm", lambda: check_vllm(cache_dir)))
    failed = 0
    for name, check in checks:
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except Exception as exc:  # each check reports its own failure; the rest still run
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
    print(json.dumps({"passed": len(checks) - failed, "failed": failed, "device": torch.cuda.get_device_name(0)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
