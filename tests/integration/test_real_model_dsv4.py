"""DeepSeek-V4 restored exactly: `kvtier warmup` stores a tiny random-init DeepSeek-V4 (sliding
window, CSA and HCA compressed layers, MTP R = 3), fresh engines restore a longer prompt's and a
diverging prompt's hits from disk into NaN-filled blocks, every restored block equals the
producer's bit for bit, and decoding from the restored state alone matches a full recompute.

Model semantics: transformers' ``models/deepseek_v4`` (``DeepseekV4HCACache`` /
``DeepseekV4CSACache``). Nothing is downloaded; the model is built from a config.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.engine.config import EngineConfig  # noqa: E402
from kvtier.engine.engine import OffloadEngine  # noqa: E402
from kvtier.policy import num_skipped_tokens  # noqa: E402
from kvtier.policy.compressed import ENTRIES, OVERLAP, SLIDING, GroupRole  # noqa: E402
from kvtier.policy.plan import load_block_plan  # noqa: E402
from kvtier.tiers.device import DeviceKVView  # noqa: E402
from kvtier.integrations.transformers import cache_plan, full_logits, load_model, next_token_logits  # noqa: E402
from kvtier.tools._warmup import model_fingerprint, run_warmup  # noqa: E402

WINDOW = 8
BLOCK = 8
R = 3  # MTP: num_speculative_tokens - 1
CSA_RATE, HCA_RATE = 4, 16
PREFIX_TOKENS = 70  # boundaries at multiples of lcm(4, 16) = 16: the longest hit is 64
TOLERANCE = 1e-5
NULL_BLOCK = 0


def tiny_deepseek_v4_config(**overrides):
    """Four layers: sliding only, CSA, HCA, CSA; window 8, HCA rate 16 (128 in the real model) so
    that short prompts have several entries; MTP declared (num_nextn_predict_layers=1)."""
    fields = dict(
        vocab_size=128, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=8, index_n_heads=2,
        index_head_dim=8, index_topk=64, n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
        sliding_window=WINDOW, max_position_embeddings=512, num_nextn_predict_layers=1, initializer_range=0.2,
    )
    fields.update(overrides)
    return transformers.DeepseekV4Config(**fields)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-tiny")
    torch.manual_seed(4)
    transformers.AutoModelForCausalLM.from_config(tiny_deepseek_v4_config(), dtype=torch.float32).save_pretrained(path)
    return path


@contextlib.asynccontextmanager
async def _restored(plan, cache_dir, fingerprint, consumer_ids):
    """An engine over ``cache_dir`` that has looked ``consumer_ids`` up and loaded its hit into fresh
    device caches full of NaN (only restored bytes may be read): yields
    ``(engine, kv_caches, hit, tables, result)``, the engine still open."""
    layout = plan.layout
    kv_caches = plan.allocate(24, torch.float32)
    for tensors in kv_caches:
        for tensor in tensors:
            tensor.fill_(float("nan"))
    async with OffloadEngine(
        layout, DeviceKVView(layout, kv_caches), EngineConfig(cache_dir=str(cache_dir)), fingerprint=fingerprint
    ) as engine:
        hit = engine.lookup(consumer_ids)
        tables = _consumer_tables(layout, hit)
        result = await engine.load(consumer_ids, hit, tables)
        yield engine, kv_caches, hit, tables, result


def _consumer_tables(layout, hit):
    """A consumer allocator's tables: fresh blocks, the sliding groups' skipped blocks -> null."""
    tables, next_block = [], NULL_BLOCK + 1
    for group in layout.groups:
        skipped = num_skipped_tokens(group, hit) // group.block_size
        table = []
        for logical in range(-(-hit // group.block_size)):
            table.append(NULL_BLOCK if logical < skipped else next_block)
            next_block += logical >= skipped
        tables.append(table)
    return tables


def _needed_rows(plan, g, hit):
    """Rows of group ``g`` the model's cache holds at ``hit``: what build_cache may read."""
    role = plan.roles[g]
    if role.kind == SLIDING:
        return max(0, hit - (WINDOW - 1)), hit
    if role.kind == ENTRIES:
        return 0, hit // role.rate
    return hit - role.rate, hit


@pytest.mark.asyncio
async def test_deepseek_v4_restores_exactly(model_dir, tmp_path):
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(8)
    prefix = torch.randint(0, 128, (PREFIX_TOKENS,), generator=generator).tolist()
    longer = prefix + torch.randint(0, 128, (9,), generator=generator).tolist()
    diverging = prefix[:40] + torch.randint(0, 128, (30,), generator=generator).tolist()
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text(json.dumps({"token_ids": prefix}) + "\n")
    cache_dir = tmp_path / "cache"
    summary = await run_warmup(model_dir, corpus, cache_dir, progress=False, block_size=BLOCK, extra_retained_tokens=R)
    assert summary.tokens == PREFIX_TOKENS and summary.chunks_stored > 0 and summary.chunks_dropped == 0
    again = await run_warmup(model_dir, corpus, cache_dir, progress=False, block_size=BLOCK, extra_retained_tokens=R)
    assert (again.skipped, again.tokens, again.chunks_stored) == (1, 0, 0)  # resumable: nothing recomputed

    model = load_model(model_dir)
    plan = cache_plan(model.config, block_size=BLOCK, extra_retained_tokens=R)
    layout = plan.layout
    assert plan.roles == (GroupRole(SLIDING), GroupRole(ENTRIES, 4), GroupRole(ENTRIES, 16), GroupRole(OVERLAP, 4))
    assert plan.layer_groups == [[0, 1, 2, 3], [1, 3], [2], [1, 3]]
    assert (layout.hit_granularity_tokens, layout.alignment_tokens) == (16, 16)
    fingerprint = model_fingerprint(transformers.AutoConfig.from_pretrained(model_dir), layout, "float32")
    assert fingerprint.hex() == summary.fingerprint

    # The producer's blocks, to compare the restored ones against bit for bit.
    captured = plan.capture(model, prefix)
    producer_tables = [list(range(-(-PREFIX_TOKENS // g.block_size))) for g in layout.groups]
    producer = plan.allocate([len(t) for t in producer_tables], torch.float32)
    plan.write(captured, producer, producer_tables, PREFIX_TOKENS)

    diffs = {}
    for name, consumer_ids, expected_hit in (("longer", longer, 64), ("diverging", diverging, 32)):
        async with _restored(plan, cache_dir, fingerprint, consumer_ids) as (engine, kv_caches, hit, tables, result):
            assert hit == expected_hit, name
            engine.check()
        assert result.ok and result.chunks_from_disk > 0
        expected = {
            (g, b) for g in range(len(layout.groups)) for _, blocks in load_block_plan(layout, g, hit) for b in blocks if b is not None
        }
        assert set(result.loaded) == expected
        # Entries groups restore every block up to H; sliding and overlap groups only their window.
        assert {b for g, b in expected if g == 2} == set(range(hit // HCA_RATE))
        assert {b for g, b in expected if g == 3} == {hit // CSA_RATE - 1}
        for g, logical in sorted(expected):
            for j in range(len(plan.layer_groups[g])):
                assert torch.equal(kv_caches[g][j][tables[g][logical]], producer[g][j][logical]), (name, g, logical, j)

        reference = full_logits(model, consumer_ids)
        logits = next_token_logits(model, plan.build_cache(model, kv_caches, tables, hit), consumer_ids, hit)
        diffs[name] = (logits - reference).abs().max().item()
        assert diffs[name] <= TOLERANCE and reference.std().item() > 0.1, (name, diffs[name])

        # Everything in the restored blocks outside what the model's cache holds at H (the R tokens
        # MTP keeps, sliding positions past the window, entries of the producer's longer prompt) is
        # never read: NaN there leaves the logits bit for bit unchanged.
        for g, logical in expected:
            lo, hi = _needed_rows(plan, g, hit)
            per_block = kv_caches[g][0].shape[1]
            for tensor in kv_caches[g]:
                block = tensor[tables[g][logical]]
                for row in range(per_block):
                    if not lo <= logical * per_block + row < hi:
                        block[row] = float("nan")
        again = next_token_logits(model, plan.build_cache(model, kv_caches, tables, hit), consumer_ids, hit)
        assert torch.equal(again, logits), name

        # Negative controls: each needed piece matters. A changed last HCA entry, first attended
        # sliding position, or CSA window-carry state moves the logits.
        for g, row in ((2, hit // HCA_RATE - 1), (0, hit - (WINDOW - 1)), (3, hit - 1)):
            per_block = kv_caches[g][0].shape[1]
            tensor = kv_caches[g][0]
            block = tensor[tables[g][row // per_block]]
            saved = block[row % per_block].clone()
            block[row % per_block] += 3.0
            moved = next_token_logits(model, plan.build_cache(model, kv_caches, tables, hit), consumer_ids, hit)
            block[row % per_block] = saved
            assert (moved - reference).abs().max().item() > 1e-3, (name, g, row)
    print(f"\nDeepSeek-V4 restore: logits max abs diff {diffs} (tolerance {TOLERANCE})")
    assert time.perf_counter() - started < 60


def test_a_restore_between_rates_is_refused(model_dir):
    plan = cache_plan(tiny_deepseek_v4_config(), block_size=BLOCK)
    kv_caches = plan.allocate(8, torch.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        plan.build_cache(None, kv_caches, [[0] * 8] * 4, 24)


def test_deepseek_v4_in_bfloat16_restores_through_float32_blocks(model_dir):
    """Loaded in bfloat16, transformers runs the compressors in bfloat16 (the gate carry stays
    float32): kvtier widens entries and carry to float32 blocks (exact) and casts back on restore."""
    model = load_model(model_dir, dtype="bfloat16")
    plan = cache_plan(model.config, block_size=BLOCK, extra_retained_tokens=R)
    ids = list(range(3, 3 + PREFIX_TOKENS + 10))
    tables = [list(range(-(-PREFIX_TOKENS // g.block_size))) for g in plan.layout.groups]
    kv_caches = plan.allocate([len(t) for t in tables], torch.bfloat16)
    assert [t[0].dtype for t in kv_caches] == [torch.bfloat16] + [torch.float32] * 3
    plan.write(plan.capture(model, ids[:PREFIX_TOKENS]), kv_caches, tables, PREFIX_TOKENS)
    logits = next_token_logits(model, plan.build_cache(model, kv_caches, tables, 64), ids, 64)
    # Bitwise equal on this machine; bounded by bf16 rounding (2^-8 relative) wherever kernels differ.
    reference = full_logits(model, ids)
    assert (logits - reference).abs().max().item() <= 2.0**-8 * reference.abs().max().item()


@pytest.mark.asyncio
async def test_past_index_topk_restored_logits_match_the_models_own_cache(tmp_path):
    # index_topk 4 and a 64-token hit: 16 CSA entries, so the indexer picks a top-k (the real
    # model's 512 is passed past ~2,048 tokens). Rounding differences between a prefill and a
    # recompute can flip that choice, so a full recompute is no reference past it; the model's own
    # cache, prefilled once and never offloaded, is: the restored state must decode as it does.
    model_dir = tmp_path / "model"
    torch.manual_seed(4)
    transformers.AutoModelForCausalLM.from_config(tiny_deepseek_v4_config(index_topk=4), dtype=torch.float32).save_pretrained(model_dir)
    generator = torch.Generator().manual_seed(8)
    prefix = torch.randint(0, 128, (PREFIX_TOKENS,), generator=generator).tolist()
    consumer_ids = prefix + torch.randint(0, 128, (9,), generator=generator).tolist()
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text(json.dumps({"token_ids": prefix}) + "\n")
    cache_dir = tmp_path / "cache"
    await run_warmup(model_dir, corpus, cache_dir, progress=False, block_size=BLOCK, extra_retained_tokens=R)
    model = load_model(model_dir)
    plan = cache_plan(model.config, block_size=BLOCK, extra_retained_tokens=R)
    layout = plan.layout
    fingerprint = model_fingerprint(transformers.AutoConfig.from_pretrained(model_dir), layout, "float32")
    async with _restored(plan, cache_dir, fingerprint, consumer_ids) as (_, kv_caches, hit, tables, result):
        pass
    assert hit == 64 and result.ok and hit // CSA_RATE > 4
    restored = next_token_logits(model, plan.build_cache(model, kv_caches, tables, hit), consumer_ids, hit)
    from kvtier.integrations.transformers._common import cache_kwarg  # transformers' name for the cache argument

    own = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([consumer_ids[:hit]]), use_cache=True, **{cache_kwarg(model): own})
    reference = next_token_logits(model, own, consumer_ids, hit)
    diff = (restored - reference).abs().max().item()
    recompute = (full_logits(model, consumer_ids) - reference).abs().max().item()
    print(f"\nDeepSeek-V4 past index_topk: restored vs own cache {diff:.2e}; own cache vs full recompute {recompute:.2e}")
    assert diff <= TOLERANCE and reference.std().item() > 0.1
