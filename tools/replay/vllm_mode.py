"""``kvtier replay --through-vllm``: a slice of the trace through vLLM 0.33's real Scheduler and
``OffloadingConnector`` on CPU (``integrations.vllm.testing.VllmCpuRig``), twice at equal total
bytes, and kvtier's engine mode on the same slice.

Primitives: ``replay_through_vllm`` (the whole comparison as a result dict), ``rig_layout`` (the
replay layout of the rig's model). Runs on the caller's thread (kvtier's tier has its own loop).

The model is one full-attention group of 512-token chunks (vLLM blocks of 16 tokens, 32 per
offloaded block), the trace's own blocks. Runs:

- ``vllm_cpu``: vLLM's CPU tier alone, ``total_chunks`` chunks.
- ``vllm_kvtier``: vLLM's CPU tier of ``cpu_chunks`` chunks plus ``KvtierTier`` (LMDB) below it
  with ``total_chunks - cpu_chunks`` chunks' worth of record bytes: the same total bytes.
- ``engine``: kvtier's engine mode with a host of ``cpu_chunks`` chunks and the same disk chunks,
  the structure of ``vllm_kvtier`` (a host in front, inclusive, writing behind to LMDB).

vLLM's GPU prefix cache is emptied after every request, so every hit comes from the offload tiers
(vLLM's CPU tier or kvtier) and all three runs count the same thing: tokens a request did not
prefill. Every block vLLM loaded is compared bitwise with what the stand-in model wrote for that
prefix (``VllmCpuRig.expected_block``); a wrong byte raises ``EngineReplayError``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from kvtier.policy import ModelLayout

from .engine_mode import EngineReplayError, _request_tokens, policy_options, replay_engine
from .layouts import ReplayLayout, _group
from .report import JsonObject
from .trace import Trace
from .workload import REPLAY_FINGERPRINT, record_bytes

__all__ = ["replay_through_vllm", "rig_layout", "vllm_policies", "VLLM_BLOCK", "CHUNK_BLOCKS"]

VLLM_BLOCK = 16  # tokens per vLLM (GPU) block
CHUNK_BLOCKS = 32  # vLLM blocks per offloaded block: 512-token chunks, the trace's blocks
_HEADS, _HEAD_SIZE = 1, 16  # one KV head of 16 bf16: 64 bytes per token (K and V)


def rig_layout() -> ReplayLayout:
    """The rig's model as a replay layout: one full-attention group, 512-token chunks, the
    bytes per block vLLM allocates for it."""
    block_bytes = VLLM_BLOCK * 2 * _HEADS * _HEAD_SIZE * 2
    return ReplayLayout("vllm-rig", ModelLayout((_group(VLLM_BLOCK, CHUNK_BLOCKS),)), (block_bytes,), ("full",))


def _vllm_env() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def vllm_policies(policy: str) -> Dict[str, str]:
    """What ``--policy NAME`` sets under vLLM: its CPU tier's eviction (vLLM has ``lru`` and
    ``arc``; the ARC names take ``arc``, every other ``lru``) and ``KvtierTier``'s
    ``eviction_policy`` and ``disk_admission`` (as ``policy_options`` sets the engine's disk)."""
    disk = policy_options(policy)
    return {"cpu": "arc" if disk["host_eviction_policy"].startswith("arc") else "lru",
            "eviction_policy": disk["eviction_policy"], "disk_admission": disk["disk_admission"]}


def _rig(cpu_chunks: int, tiers: List[Dict[str, object]], max_len: int, model_dir: Path, cpu_policy: str = "lru"):
    _vllm_env()
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.integrations.vllm.testing import VllmCpuRig

    spec = FullAttentionSpec(block_size=VLLM_BLOCK, num_kv_heads=_HEADS, head_size=_HEAD_SIZE, dtype=torch.bfloat16)
    return VllmCpuRig([spec], tiers, retention=0, num_gpu_blocks=2 * (max_len // VLLM_BLOCK) + 4,
                      cpu_chunks=cpu_chunks, blocks_per_chunk=CHUNK_BLOCKS, max_model_len=max_len,
                      model_dir=model_dir, cpu_eviction_policy=cpu_policy)


def _run_vllm(trace: Trace, cpu_chunks: int, tiers: List[Dict[str, object]], max_len: int, model_dir: Path,
              progress: Optional[Callable[[int], None]], cpu_policy: str = "lru") -> JsonObject:
    """Every request of ``trace`` through one rig; per request the hit tokens, split by the tier
    that served them (chunks kvtier promoted into vLLM's CPU tier during the request, the rest
    from the CPU tier)."""
    rig = _rig(cpu_chunks, tiers, max_len, model_dir, cpu_policy)
    chunk_tokens = VLLM_BLOCK * CHUNK_BLOCKS
    promoted = [0]
    jobs: Dict[int, int] = {}
    kvtier = rig.secondary_tiers[0] if rig.secondary_tiers else None
    if kvtier is not None:
        submit, finished = kvtier.submit_load, kvtier.get_finished_jobs

        def counting_submit(job):  # how many chunks each promotion asked kvtier for
            jobs[job.job_id] = len(job.keys)
            return submit(job)

        def counting_finished():  # ... and how many of them it delivered
            results = list(finished())
            for result in results:
                asked = jobs.pop(result.job_id, None)
                if asked is not None:
                    promoted[0] += asked if result.success else len(result.successful_keys or ())
            return results

        kvtier.submit_load, kvtier.get_finished_jobs = counting_submit, counting_finished
    n = len(trace)
    hits = np.zeros(n, dtype=np.int64)
    from_kvtier = np.zeros(n, dtype=np.int64)
    verified = 0
    started = time.perf_counter()
    try:
        for r in range(n):
            prompt = _request_tokens(trace, r)
            before = promoted[0]
            record = rig.run(prompt)
            for group, blocks in record.loaded.items():
                for logical in sorted(blocks):
                    got = rig.block_bytes(group, record.block_ids[group][logical])
                    if got != rig.expected_block(prompt, group, logical):
                        raise EngineReplayError(f"through vLLM: request {r}: block {logical} loaded bytes differ "
                                                "from what the model wrote for that prefix")
                    verified += 1
            hits[r] = record.external_hit_tokens
            from_kvtier[r] = min(hits[r], (promoted[0] - before) * chunk_tokens)
            # Only the offload tiers may serve the next request: empty vLLM's GPU prefix cache
            # (not its CPU tier) and zero the GPU bytes, so a stale block cannot pass the check.
            if not rig.scheduler.reset_prefix_cache(reset_connector=False):
                raise RuntimeError("vLLM refused to reset its GPU prefix cache (requests still running)")
            for tensor in rig.kv.values():
                tensor.zero_()
            if kvtier is not None:
                # Between two requests (a server's idle moment, never inside a scheduler step):
                # kvtier's index catches up with the records its disk evicted, as the engine's
                # does at once; without it the next request can be answered HIT for a record
                # already gone, and vLLM recomputes that chunk (kvtier_failed_promotions).
                kvtier.settle()
            if progress is not None:
                progress(1)
        stats = kvtier.statistics() if kvtier is not None else {}
    finally:
        rig.shutdown()
    tokens = int(sum(r.input_length for r in trace.requests))
    served = {"vllm_cpu": int(hits.sum() - from_kvtier.sum())}
    if kvtier is not None:
        served["kvtier_disk"] = int(from_kvtier.sum())
        if stats.get("vllm_load_mismatches"):
            raise EngineReplayError(f"through vLLM: {int(stats['vllm_load_mismatches'])} records kvtier read did not "
                                    "match their keys")
    return {"hit_tokens": int(hits.sum()), "input_tokens": tokens, "hit_rate": float(hits.sum() / tokens),
            "served_tokens": served, "blocks_verified": verified, "wrong_bytes": 0,
            "wall_s": time.perf_counter() - started, "per_request_hits": hits.tolist(),
            "kvtier_failed_promotions": int(stats.get("vllm_promotions_failed", 0)), "kvtier_stats": stats}


def replay_through_vllm(trace: Trace, *, total_chunks: int, cpu_chunks: int, policy: str = "lru",
                        progress: Optional[Callable[[int], None]] = None) -> JsonObject:
    """The three runs (module docstring) on ``trace``; ``total_chunks`` chunks of total budget of
    which ``cpu_chunks`` are vLLM's CPU tier in the run with kvtier; ``policy``: a ``--policy``
    name (``vllm_policies``; the engine run takes it as engine mode does). The result's
    ``agreement_points`` is 100 x (vLLM with kvtier - engine mode) token-weighted hit rate."""
    if not 4 <= cpu_chunks < total_chunks:
        raise ValueError(f"--vllm-cpu-chunks must be >= 4 and below --vllm-chunks ({total_chunks}), got {cpu_chunks}")
    layout = rig_layout()
    disk_chunks = total_chunks - cpu_chunks
    record = record_bytes(layout, REPLAY_FINGERPRINT)[0]
    max_len = max(r.input_length for r in trace.requests) + VLLM_BLOCK
    work = Path(tempfile.mkdtemp(prefix="kvtier-replay-vllm-"))
    try:
        under = vllm_policies(policy)
        alone = _run_vllm(trace, total_chunks, [], max_len, work / "model", progress, under["cpu"])
        tier = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "cache_dir": str(work / "kv"),
                "disk_capacity_bytes": disk_chunks * record, "compression": 0,
                "eviction_policy": under["eviction_policy"], "disk_admission": under["disk_admission"]}
        with_kvtier = _run_vllm(trace, cpu_chunks, [tier], max_len, work / "model", progress, under["cpu"])
        engine = asyncio.run(replay_engine(trace, layout, host_slots=[cpu_chunks], disk_bytes=disk_chunks * record,
                                           cache_dir=str(work / "engine"), retention_interval=0, policy=policy))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    engine_tiers = {name: int(v.sum()) for name, v in engine.read_bytes.items()}
    chunk = layout.full_chunk_bytes(0)
    chunk_tokens = VLLM_BLOCK * CHUNK_BLOCKS
    engine_served = {f"kvtier_{name}": count // chunk * chunk_tokens for name, count in engine_tiers.items()}
    engine_hits = int(engine.hit_tokens.sum())
    tokens = with_kvtier["input_tokens"]
    return {
        "requests": len(trace), "input_tokens": tokens, "chunk_tokens": chunk_tokens, "chunk_bytes": chunk,
        "record_bytes": record, "total_chunks": total_chunks, "cpu_chunks": cpu_chunks, "disk_chunks": disk_chunks,
        "policy": policy, "vllm_policies": under,
        "vllm_cpu": alone, "vllm_kvtier": with_kvtier,
        "engine": {"hit_tokens": engine_hits, "hit_rate": engine_hits / tokens, "served_tokens": engine_served,
                   "chunks_verified": engine.extra["chunks_verified"], "wrong_bytes": 0,
                   "per_request_hits": engine.hit_tokens.tolist()},
        "agreement_points": 100 * (with_kvtier["hit_rate"] - engine_hits / tokens),
        "kvtier_gain_points": 100 * (with_kvtier["hit_rate"] - alone["hit_rate"]),
    }


def format_vllm_report(result: JsonObject) -> str:
    """The comparison as a table: hit tokens per serving tier and the hit rates."""
    rows = [("run", "hit rate", "hit tokens", "vLLM CPU", "kvtier host", "kvtier disk", "verified")]
    for name, label in (("vllm_cpu", f"vLLM CPU tier alone ({result['total_chunks']} chunks)"),
                        ("vllm_kvtier", f"vLLM CPU ({result['cpu_chunks']}) + KvtierTier ({result['disk_chunks']})"),
                        ("engine", f"kvtier engine host ({result['cpu_chunks']}) + disk ({result['disk_chunks']})")):
        run = result[name]
        served = run["served_tokens"]
        verified = run.get("blocks_verified", run.get("chunks_verified"))
        rows.append((label, f"{100 * run['hit_rate']:.2f}%", str(run["hit_tokens"]), str(served.get("vllm_cpu", "-")),
                     str(served.get("kvtier_host", "-")), str(served.get("kvtier_disk", "-")), str(verified)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    under = result["vllm_policies"]
    lines.append(f"--policy {result['policy']}: vLLM's CPU tier {under['cpu']}, KvtierTier eviction_policy "
                 f"{under['eviction_policy']}, disk_admission {under['disk_admission']}")
    lines.append(f"{result['requests']} requests, {result['input_tokens']} input tokens, chunks of "
                 f"{result['chunk_tokens']} tokens; vLLM + kvtier - engine mode: {result['agreement_points']:+.3f} "
                 f"points; vLLM + kvtier - vLLM alone: {result['kvtier_gain_points']:+.3f} points; 0 wrong bytes")
    return "\n".join(lines)
