"""One vLLM "server" process over a kvtier cache, built in EngineCore's order (the Scheduler and its
secondary tiers first, then ``init_none_hash``: ``testing.VllmCpuRig``). Run as
``python vllm_server_child.py MODE CACHE_DIR HASH_ALGORITHM``; prints one JSON line.

``warm-seeded``: NONE_HASH is already seeded when the tier is built (a process that ran an engine
before, or a warmup that seeds first), then ``warm_through_vllm`` stores the prompt.
``serve``: a fresh server's first request is the prompt + 1 token: its hit tokens, and whether every
restored block is bitwise the producer's.
``rebuild``: one engine stores the prompt and shuts down; a second engine, built in the same
process, serves the prompt + 1 token (a restart of vLLM's engine inside one process).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvtier.integrations.vllm.testing import VllmCpuRig
from kvtier.integrations.vllm.warmup import warm_through_vllm

PROMPT = [(i * 7) % 900 + 3 for i in range(33)]
CONSUMER = PROMPT + [5]


def make_rig(cache_dir: Path, hash_algorithm: str) -> VllmCpuRig:
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=8)
    tier = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "cache_dir": str(cache_dir)}
    return VllmCpuRig([fa, swa], [tier], model_dir=cache_dir.parent / "model", hash_algorithm=hash_algorithm)


def serve(rig: VllmCpuRig) -> dict:
    record = rig.run(CONSUMER)
    bitwise = all(
        rig.block_bytes(g, record.block_ids[g][b]) == rig.expected_block(PROMPT, g, b)
        for g, blocks in record.loaded.items() for b in blocks
    )
    tier = rig.secondary_tiers[0]
    return {"hit_tokens": record.external_hit_tokens, "loaded": {str(g): sorted(b) for g, b in record.loaded.items()},
            "bitwise": bitwise, "hash_algorithm": tier.layout.hash_algorithm,
            "failed": tier.counters["promotions_failed"]}


def main(mode: str, cache_dir: Path, hash_algorithm: str) -> dict:
    if mode == "warm-seeded":
        init_none_hash(get_hash_fn_by_name(hash_algorithm))
    rig = make_rig(cache_dir, hash_algorithm)
    try:
        if mode == "warm-seeded":
            return {"stored": warm_through_vllm(rig, [PROMPT]), "hash_algorithm": rig.secondary_tiers[0].layout.hash_algorithm}
        if mode == "serve":
            return serve(rig)
        rig.run(PROMPT)
    finally:
        rig.shutdown()
    again = make_rig(cache_dir, hash_algorithm)
    try:
        out = serve(again)
    finally:
        again.shutdown()
    out["layout_files"] = sorted(p.name for p in cache_dir.glob("vllm-layout-*.json"))
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])))
