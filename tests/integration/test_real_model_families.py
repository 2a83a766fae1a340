"""Model families beyond Gemma-3 through kvtier's standard cache plan, each restored exactly:
Gemma-4 (full-attention layers with a larger head_dim and their own KV head count than sliding
ones; ``kv_sharing_modes`` like ``[None, None, 'store', 'store']``), MiMo-V2-Flash (K head 24, V
head 16; sliding layers with twice the KV heads), DeepSeek-V3 (MLA: one latent head, K = compressed KV 16, V = RoPE key 4).
And the configurations kvtier refuses, each with one line saying why, before loading anything.

Each case: `kvtier warmup` on a tiny random-init model saved to a temporary directory, a fresh
engine restores a longer prompt's hit from disk into junk-filled blocks, every restored block is
bitwise the producer's, and decoding from the restored blocks (junk before each sliding window)
matches a full recompute in float32.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.engine.config import EngineConfig  # noqa: E402
from kvtier.engine.engine import OffloadEngine  # noqa: E402
from kvtier.policy import num_skipped_tokens  # noqa: E402
from kvtier.policy.plan import load_block_plan  # noqa: E402
from kvtier.tiers.device import DeviceKVView  # noqa: E402
from kvtier.integrations.transformers import cache_plan, full_logits, layer_kv_shapes, load_model, next_token_logits  # noqa: E402
from kvtier.tools._warmup import model_fingerprint, run_warmup  # noqa: E402

BLOCK = 8
WINDOW = 16
PREFIX = 48
TOLERANCE = 1e-5
SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256,
             initializer_range=0.2)


def gemma4_config(**overrides):
    fields = dict(SMALL, intermediate_size=128, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                  num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=128)
    fields.update(overrides)
    return transformers.Gemma4TextConfig(**fields)


def mimo_config():
    return transformers.MiMoV2FlashConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=24,
                                          v_head_dim=16, sliding_window=WINDOW, n_routed_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32)


def deepseek_v3_config():
    return transformers.DeepseekV3Config(**SMALL, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=16,
                                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                         n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                         n_group=1, topk_group=1)


def llama4_config():
    # Three chunked layers and one full-attention layer. Chunks of 32: the hit (48) ends inside the
    # chunk [32, 64), so the decoded tokens read restored positions 32..47 of the chunked layers.
    return transformers.Llama4TextConfig(**SMALL, intermediate_size=128, intermediate_size_mlp=128, num_key_value_heads=2,
                                         head_dim=16, attention_chunk_size=2 * WINDOW, num_local_experts=2,
                                         interleave_moe_layer_step=1, no_rope_layers=[1, 1, 1, 0])


FAMILIES = {
    "gemma4": (gemma4_config, [(2, 32, 32) if i % 2 else (1, 16, 16) for i in range(4)]),
    # "unified" checkpoints: bidirectional among an image's own tokens only; text stays causal.
    "gemma4-vision": (lambda: gemma4_config(use_bidirectional_attention="vision"),
                      [(2, 32, 32) if i % 2 else (1, 16, 16) for i in range(4)]),
    "llama4": (llama4_config, [(2, 16, 16)] * 4),
    "mimo_v2_flash": (mimo_config, [(2, 24, 16)] + [(4, 24, 16)] * 3),
    "deepseek_v3": (deepseek_v3_config, [(1, 16, 4)] * 4),
}


def _consumer_tables(layout, hit):
    tables, next_block = [], 1
    for group in layout.groups:
        skipped = num_skipped_tokens(group, hit) // group.block_size
        table = []
        for logical in range(-(-hit // group.block_size)):
            table.append(0 if logical < skipped else next_block)
            next_block += logical >= skipped
        tables.append(table)
    return tables


@pytest.mark.asyncio
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_restores_exactly(family, tmp_path):
    make_config, shapes = FAMILIES[family]
    config = make_config()
    assert layer_kv_shapes(config) == shapes
    torch.manual_seed(3)
    model_dir = tmp_path / family
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 128, (PREFIX,), generator=generator).tolist()
    consumer_ids = prefix + torch.randint(3, 128, (5,), generator=generator).tolist()
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text(json.dumps({"token_ids": prefix}) + "\n")
    geometry = dict(block_size=BLOCK, extra_retained_tokens=2)
    summary = await run_warmup(model_dir, corpus, tmp_path / "cache", progress=False, **geometry)
    assert summary.chunks_stored > 0 and summary.chunks_dropped == 0

    model = load_model(model_dir)
    plan = cache_plan(model.config, **geometry)
    layout = plan.layout
    fingerprint = model_fingerprint(model.config, layout, "float32")
    assert fingerprint.hex() == summary.fingerprint
    kv_caches = plan.allocate(16, torch.float32)
    for tensors in kv_caches:
        for tensor in tensors:
            tensor.copy_(1e4 * torch.randn(tensor.shape, generator=generator))
    async with OffloadEngine(
        layout, DeviceKVView(layout, kv_caches), EngineConfig(cache_dir=str(tmp_path / "cache")), fingerprint=fingerprint
    ) as engine:
        hit = engine.lookup(consumer_ids)
        tables = _consumer_tables(layout, hit)
        result = await engine.load(consumer_ids, hit, tables)
    assert hit == PREFIX and result.ok
    expected = {(g, b) for g in range(len(layout.groups)) for _, bs in load_block_plan(layout, g, hit) for b in bs if b is not None}
    assert set(result.loaded) == expected
    producer_tables = [list(range(PREFIX // BLOCK))] * len(layout.groups)
    producer = plan.allocate(PREFIX // BLOCK, torch.float32)
    plan.write(plan.capture(model, prefix), producer, producer_tables, PREFIX)
    for g, logical in expected:
        for j in range(len(plan.layer_groups[g])):
            assert torch.equal(kv_caches[g][j][tables[g][logical]], producer[g][j][logical]), (g, logical, j)
    reference = full_logits(model, consumer_ids)
    cache = plan.build_cache(model, kv_caches, tables, hit, generator=generator)
    diff = (next_token_logits(model, cache, consumer_ids, hit) - reference).abs().max().item()
    print(f"\n{family}: groups {[len(l) for l in plan.layer_groups]} layers, block shapes "
          f"{[tuple(t[0].shape[1:]) for t in kv_caches]}, logits max abs diff {diff:.2e}")
    assert diff <= TOLERANCE and reference.std().item() > 0.1


def dory_config(**overrides):
    fields = dict(SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                  n_input_layers=1, n_output_layers=1, n_recurrent_loops=2)
    fields.update(overrides)
    return transformers.DoryConfig(**fields)


REFUSED = {
    "gemma4-shared-kv": (
        lambda: gemma4_config(num_kv_shared_layers=2),
        r"^unsupported model config \(gemma4_text\): layers \[2, 3\] reuse another layer's KV \(num_kv_shared_layers=2\)",
    ),
    "dory-last-loop": (
        lambda: dory_config(recurrent_kv_cache_mode="last_loop"),
        r"^unsupported model config \(dory\): recurrent_kv_cache_mode='last_loop' is lossy: one KV per recurrent "
        r"layer is written by the last loop only",
    ),
    "dory-per-loop": (dory_config, r"n_recurrent_loops=2 keeps one KV per loop"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_refusals_are_one_line_before_loading_and_leave_no_cache_dir(case, tmp_path):
    make_config, message = REFUSED[case]
    with pytest.raises(ValueError, match=message) as caught:
        cache_plan(make_config())
    assert "\n" not in str(caught.value)
    model_dir = tmp_path / "model"
    make_config().save_pretrained(model_dir)  # a config and no weights: refused before any load
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text(json.dumps({"token_ids": list(range(3, 40))}) + "\n")
    with pytest.raises(ValueError, match=message):
        await run_warmup(model_dir, corpus, tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists()


def test_gemma4_without_shared_layers_is_accepted_with_per_group_shapes():
    config = gemma4_config()
    assert config.kv_sharing_modes == [None, None, "store", "store"]
    plan = cache_plan(config, block_size=BLOCK)
    assert plan.layer_groups == [[1, 3], [0, 2]]
    assert [tuple(t[0].shape[1:]) for t in plan.allocate(1, torch.float32)] == [(2, BLOCK, 2, 32), (2, BLOCK, 1, 16)]
    with pytest.raises(ValueError, match=r"differ per layer"):  # never transformers' AmbiguousGlobal... error
        from kvtier.integrations.transformers import kv_head_shape

        kv_head_shape(config)


def test_a_cache_shape_the_config_misreads_is_refused():
    from kvtier.integrations.transformers import check_captured_shapes

    config = mimo_config()
    kv = [(torch.zeros(2, 3, 24), torch.zeros(2, 3, 16))] * 4  # sliding layers really hold 4 heads
    with pytest.raises(ValueError, match=r"layer 1 caches K 2x24 and V 2x16 \(heads x dim\), but its config gives 4x24"):
        check_captured_shapes(config, kv)


@pytest.mark.asyncio
async def test_a_warmup_cancelled_before_storing_leaves_no_cache_dir(tmp_path):
    import asyncio

    from kvtier.integrations.transformers import tiny_hybrid_config

    model_dir = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(tiny_hybrid_config()).save_pretrained(model_dir)
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text(json.dumps({"token_ids": list(range(3, 120))}) + "\n")
    cache_dir = tmp_path / "cache"
    task = asyncio.ensure_future(run_warmup(model_dir, corpus, cache_dir, progress=False))
    for _ in range(100_000):  # bounded (~10 s): the engine opens within a second or two
        if cache_dir.exists() or task.done():
            break
        await asyncio.sleep(1e-4)  # far shorter than the forward pass that precedes any store
    assert cache_dir.exists(), "the engine never created its directory"
    task.cancel()  # lands at the next await: the forward pass, before anything is stored
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not cache_dir.exists()


def test_refusals_name_the_model_not_kvtier_internals():
    from kvtier.integrations.transformers import layer_types_from_config

    for value in ("all",):  # (True, Gemma-3's embedders: test_real_model.py)
        with pytest.raises(ValueError, match=rf"^unsupported model config \(gemma4_text\): use_bidirectional_attention={value!r} "
                                             r"is not a causal KV cache \(every token attends to later ones\)$"):
            layer_types_from_config(gemma4_config(use_bidirectional_attention=value))
    config = gemma4_config(layer_types=["sliding_attention", "linear_attention"] * 2)
    with pytest.raises(ValueError) as caught:
        layer_types_from_config(config)
    assert str(caught.value) == (
        "unsupported model config (gemma4_text): layer types ['linear_attention'] (kvtier supports 'full_attention' "
        "and 'sliding_attention', and DeepSeek-V4's compressed attention)"
    )


@pytest.mark.asyncio
async def test_a_model_whose_own_forward_fails_the_probe_is_one_line(tmp_path):
    # MLA with num_key_value_heads != num_attention_heads: transformers' own forward fails.
    config = deepseek_v3_config()
    config.num_key_value_heads = 2
    model_dir = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text(json.dumps({"token_ids": list(range(3, 40))}) + "\n")
    with pytest.raises(ValueError, match=rf"^the model in '{model_dir}' fails its own forward pass on an 8-token probe "
                                         r"\(RuntimeError: .*\); its config does not describe a model that runs$") as caught:
        await run_warmup(model_dir, corpus, tmp_path / "cache", progress=False, block_size=BLOCK)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "cache").exists()
