"""``kvtier replay --through-vllm``: a slice through vLLM 0.33's real Scheduler + OffloadingConnector
on CPU (its CPU tier alone, then with ``KvtierTier`` below it at equal total chunks) and kvtier's
engine mode configured as the run with kvtier, on a prompt trace whose documents recur often
enough for every tier to evict and serve. vLLM is installed by README's install command (no skip).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

CHUNK = 512


def write_trace(path, requests=36, documents=6, seed=7):
    """Each prompt: one of ``documents`` shared 1024-token documents (two chunks), then a
    request-own 600 tokens (one more complete chunk, never hit); a skewed choice of document.
    Returns the path and each request's document."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 999) for _ in range(2 * CHUNK)] for _ in range(documents)]
    chosen = []
    with open(path, "w") as f:
        for i in range(requests):
            chosen.append(min(int(rng.expovariate(0.5)), documents - 1))
            own = [rng.randrange(1, 999) for _ in range(600)]
            f.write(json.dumps({"timestamp": i, "token_ids": docs[chosen[-1]] + own}) + "\n")
    return path, chosen


def test_through_vllm_alone_and_with_kvtier_and_engine_mode_agree(tmp_path):
    """vLLM's CPU tier (4 chunks) evicts; kvtier's disk (56 chunks) holds the slice's 48 distinct
    chunks: every repeated document is a whole hit in all three runs, request by request, served
    partly by vLLM's CPU tier (or kvtier's host) and partly by kvtier's disk."""
    trace, chosen = write_trace(tmp_path / "prompts.jsonl")
    done = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "replay", "--trace", str(trace), "--through-vllm",
                           "--vllm-chunks", "60", "--vllm-cpu-chunks", "4", "--json"],
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    tokens = 36 * (2 * CHUNK + 600)
    assert result["requests"] == 36 and result["input_tokens"] == tokens
    assert (result["cpu_chunks"], result["disk_chunks"]) == (4, 56)
    expected = [2 * CHUNK if doc in chosen[:i] else 0 for i, doc in enumerate(chosen)]
    alone, with_kvtier, engine = result["vllm_cpu"], result["vllm_kvtier"], result["engine"]
    for run in (alone, with_kvtier, engine):
        assert sum(run["served_tokens"].values()) == run["hit_tokens"] == sum(run["per_request_hits"])
        assert run["hit_rate"] == run["hit_tokens"] / tokens
        assert run["per_request_hits"] == expected  # a document seen before, whole
        assert run["wrong_bytes"] == 0
    # every block vLLM loaded was compared bitwise (16-token vLLM blocks, one group)
    assert alone["blocks_verified"] == alone["hit_tokens"] // 16
    assert with_kvtier["blocks_verified"] == with_kvtier["hit_tokens"] // 16
    assert engine["chunks_verified"] == engine["hit_tokens"] // CHUNK
    assert set(alone["served_tokens"]) == {"vllm_cpu"}
    assert set(with_kvtier["served_tokens"]) == {"vllm_cpu", "kvtier_disk"}
    # each tier served: vLLM's CPU tier and kvtier's disk under vLLM; host and disk in engine mode
    assert with_kvtier["served_tokens"]["vllm_cpu"] > 0 and with_kvtier["served_tokens"]["kvtier_disk"] > 0
    assert engine["served_tokens"]["kvtier_host"] > 0 and engine["served_tokens"]["kvtier_disk"] > 0
    assert with_kvtier["kvtier_failed_promotions"] == 0
    # the agreement: the same hits request by request (asserted above), so 0 points apart
    assert result["agreement_points"] == 0 and result["kvtier_gain_points"] == 0
    assert result["agreement_points"] == 100 * (with_kvtier["hit_rate"] - engine["hit_rate"])
    assert result["kvtier_gain_points"] == 100 * (with_kvtier["hit_rate"] - alone["hit_rate"])
    assert result["hit_rate"] == with_kvtier["hit_rate"]


def test_through_vllm_refuses_options_it_does_not_use(tmp_path):
    trace, _ = write_trace(tmp_path / "prompts.jsonl", requests=2)
    for extra, message in ((["--layout", "gpt-oss-120b"], "replays its own model"),
                           (["--simulate"], "runs alone: not with --sweep, --simulate or --remote"),
                           (["--vllm-chunks", "8", "--vllm-cpu-chunks", "8"], "--vllm-cpu-chunks must be >= 4 and below")):
        done = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "replay", "--trace", str(trace),
                               "--through-vllm", *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_wrong_byte_vllm_loaded_fails_the_run(capsys, monkeypatch, tmp_path):
    # vLLM's CPU -> GPU copy flips one bit of the first block it loads: the run must stop, exit 1.
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvtier.integrations.vllm.testing import CpuCopyWorker
    from kvtier.tools.cli import main

    trace, _ = write_trace(tmp_path / "prompts.jsonl", requests=8)
    original = CpuCopyWorker._copy

    def flipping_copy(self, job_id, gpu_to_cpu, src_spec, dst_spec):
        done = original(self, job_id, gpu_to_cpu, src_spec, dst_spec)
        if not gpu_to_cpu:
            self._gpu[0][int(dst_spec.block_ids[0])][0] ^= 1
        return done

    monkeypatch.setattr(CpuCopyWorker, "_copy", flipping_copy)
    assert main(["replay", "--trace", str(trace), "--through-vllm", "--vllm-chunks", "60", "--vllm-cpu-chunks", "4",
                 "--no-progress"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("kvtier: error: wrong bytes loaded: through vLLM: request ") and "differ" in error
