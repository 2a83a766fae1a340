"""`kvtier warmup --key-scheme vllm --model DIR` fills a cache offline with a real model's KV in
vLLM's row layout; a fresh vLLM scheduler (vLLM's own Scheduler + OffloadingConnector on CPU)
then hits on its first request and restores, block by block, exactly the model's K/V bytes.

The expected bytes are computed here independently: the model's own past_key_values for the
prompt, laid out as vLLM 0.33's LBNHC or LBHNC page per block.
"""

from __future__ import annotations

import inspect
import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvtier.integrations.vllm.testing import VllmCpuRig
from kvtier.tools.cli import main
from kvtier.integrations.transformers import tiny_hybrid_config

BLOCK = 16
WINDOW = 16
HEADS = 2
HEAD_DIM = 16
PROMPT = [(i * 37) % 120 + 3 for i in range(3 * BLOCK)]
CONSUMER = PROMPT + [5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-warm-model")
    config = tiny_hybrid_config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                                sliding_window=WINDOW, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, initializer_range=0.2)
    torch.manual_seed(99)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def make_rig(tmp_path, retention=0, cache="kv") -> VllmCpuRig:
    fa = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                            sliding_window=WINDOW)
    tier = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "cache_dir": str(tmp_path / cache)}
    return VllmCpuRig([fa, swa], [tier], retention=retention, model_dir=tmp_path / "rig-model")


def model_pages(model_dir, prompt, kv_layout):
    """Per layer, block -> page bytes from the model's own past_key_values: [tokens, heads, K|V]
    for LBNHC, [heads, tokens, K|V] for LBHNC, in bfloat16."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    cache = transformers.DynamicCache()  # no config: sliding layers keep every position
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]), use_cache=True, **{name: cache})
    pages = []
    for layer in cache.layers:
        keys, values = layer.keys[0], layer.values[0]  # [heads, seq, dim]
        per_block = {}
        for b in range(len(prompt) // BLOCK):
            cell = torch.cat([keys[:, b * BLOCK : (b + 1) * BLOCK], values[:, b * BLOCK : (b + 1) * BLOCK]], dim=-1)
            if kv_layout == "LBNHC":
                cell = cell.permute(1, 0, 2)  # [tokens, heads, K|V]
            per_block[b] = cell.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
        pages.append(per_block)
    return pages


# retention -> (chunks warmed, coverage line): vLLM stores every full-attention block and the
# sliding-window blocks its retention interval keeps (at 0 only the replay boundary 47's: block 1)
WARMED = {
    0: (4, "prompt 1: group 0: 3/3 chunks (3 leading), group 1: 1/3 chunks (0 leading)"),
    None: (6, "prompt 1: group 0: 3/3 chunks (3 leading), group 1: 3/3 chunks (3 leading)"),
    16: (6, "prompt 1: group 0: 3/3 chunks (3 leading), group 1: 3/3 chunks (3 leading)"),
    32: (4, "prompt 1: group 0: 3/3 chunks (3 leading), group 1: 1/3 chunks (0 leading)"),
}


@pytest.mark.parametrize("retention, kv_layout", [(0, "LBNHC"), (None, "LBNHC"), (16, "LBNHC"), (32, "LBNHC"), (0, "LBHNC")],
                         ids=["retention0", "retentionNone", "retention16", "retention32", "retention0-HND"])
def test_offline_model_warmup_then_a_fresh_scheduler_restores_the_models_kv(model_dir, tmp_path, capsys, retention,
                                                                             kv_layout):
    from kvtier.integrations.vllm.warmup import load_layout, vllm_chunk_keys

    make_rig(tmp_path, retention).shutdown()  # a server started once: its KvtierTier left the layout file
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": PROMPT}) + "\n")
    args = ["warmup", "--key-scheme", "vllm", "--model", str(model_dir), "--prompts", str(prompts),
            "--cache-dir", str(tmp_path / "kv"), "--vllm-kv-cache-layout", kv_layout,
            "--retention-interval", str(retention).lower()]
    chunks, coverage = WARMED[retention]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines() == [f"warmed 1 prompts: {chunks} chunks stored, 0 already present", coverage]
    assert main(args) == 0  # idempotent
    assert capsys.readouterr().out.splitlines()[0] == f"warmed 1 prompts: 0 chunks stored, {chunks} already present"

    # agreement: the warmup stored exactly the (group, chunk) set vLLM itself stores for the prompt
    producer = make_rig(tmp_path, retention, cache="producer")
    try:
        produced = producer.run(PROMPT)
    finally:
        producer.shutdown()
    expected = model_pages(model_dir, PROMPT, kv_layout)
    server = make_rig(tmp_path, retention)
    try:
        tier = server.secondary_tiers[0]
        warmed = {(k.group_id, k.chunk_index) for k in vllm_chunk_keys(PROMPT, load_layout(tmp_path / "kv"))
                  if tier.index_contains(k.offload_key)}
        assert warmed == {(g, b) for g, blocks in produced.stored.items() for b in blocks}
        consumed = server.run(CONSUMER)  # the fresh scheduler's first request
        hit = 3 * BLOCK if (1, 2) in warmed else 2 * BLOCK  # the window at 48 is block 2, at 32 block 1
        assert consumed.external_hit_tokens == hit
        assert dict(consumed.loaded) == {0: set(range(hit // BLOCK)), 1: {hit // BLOCK - 1}}
        for group, blocks in consumed.loaded.items():
            for logical in blocks:
                got = server.block_bytes(group, consumed.block_ids[group][logical])
                assert got == expected[group][logical], (group, logical)
        assert server.run(PROMPT + [7], cache_salt="tenant-b").external_hit_tokens == 0  # salt: other keys
    finally:
        server.shutdown()


def test_a_layout_the_model_cannot_fill_is_refused(model_dir, tmp_path, capsys):
    make_rig(tmp_path).shutdown()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": PROMPT}) + "\n")
    base = ["warmup", "--key-scheme", "vllm", "--model", str(model_dir), "--prompts", str(prompts),
            "--cache-dir", str(tmp_path / "kv")]
    assert main(base) != 0
    assert "(kv_cache_layout is null); pass --vllm-kv-cache-layout" in capsys.readouterr().err
    assert main(base + ["--vllm-kv-cache-layout", "BLHNC"]) != 0
    assert "KV cache layout 'BLHNC' is not supported offline" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--vllm-kv-cache-layout", "LBNHC", "--retention-interval", "-1"])
    assert "must be 'none' or an int >= 0, got '-1'" in capsys.readouterr().err
