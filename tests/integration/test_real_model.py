"""The real-model proof that coverage is right: warmup stores a tiny hybrid Gemma-3's KV, a fresh
engine restores a prefix hit from disk into fresh blocks, and decoding from those blocks alone
(sliding layers see only their retained window, junk before it) matches a full recompute.

The model is random-initialised from a config and saved to a temporary directory: nothing is
downloaded. Weights are drawn with a large initializer range so that attention is far from uniform
and a wrong position in the window would show in the logits.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.engine.config import EngineConfig  # noqa: E402
from kvtier.engine.engine import OffloadEngine  # noqa: E402
from kvtier.policy import AttentionGroup, num_skipped_tokens, retained_interval  # noqa: E402
from kvtier.tiers.device import DeviceKVView  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    allocate_kv_blocks,
    build_cache_from_blocks,
    capture_kv,
    full_logits,
    layout_from_config,
    load_model,
    next_token_logits,
    read_kv_from_blocks,
    tiny_hybrid_config,
    write_kv_to_blocks,
)
from kvtier.tools._warmup import model_fingerprint, run_warmup  # noqa: E402

WINDOW = 32
BLOCK = 16
PREFIX_TOKENS = 96
EXTRA_TOKENS = 7
TOLERANCE = 1e-5
NULL_BLOCK = 0  # vLLM-style: one real block whose bytes are junk, shared by every skipped block


def _gemma3_config(**overrides):
    fields = dict(sliding_window=WINDOW, initializer_range=0.2)  # far from uniform attention
    fields.update(overrides)
    return tiny_hybrid_config(**fields)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-tiny")
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(_gemma3_config(), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def _prompts(shared=PREFIX_TOKENS):
    """The warmed prompt, and a consumer prompt sharing its first ``shared`` tokens."""
    generator = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 128, (PREFIX_TOKENS,), generator=generator).tolist()
    suffix = torch.randint(3, 128, (PREFIX_TOKENS + EXTRA_TOKENS - shared,), generator=generator).tolist()
    return prefix, prefix[:shared] + suffix


def _consumer_tables(layout, hit):
    """Block tables a consumer's allocator would give a hit of ``hit`` tokens: every logical block
    gets a fresh device block, except a sliding group's skipped leading blocks (num_skipped_tokens),
    which all map to the null block."""
    tables = []
    next_block = NULL_BLOCK + 1
    for group in layout.groups:
        skipped_blocks = num_skipped_tokens(group, hit) // group.block_size
        table = []
        for logical in range(-(-hit // group.block_size)):
            if logical < skipped_blocks:
                table.append(NULL_BLOCK)
            else:
                table.append(next_block)
                next_block += 1
        tables.append(table)
    return tables


async def _restore(model_dir, cache_dir, layout, layer_groups, config, consumer_ids):
    """A fresh engine (new objects, fingerprint recomputed) loads the hit into fresh blocks."""
    fingerprint = model_fingerprint(transformers.AutoConfig.from_pretrained(model_dir), layout, "float32")
    kv_caches = allocate_kv_blocks(config, layout, layer_groups, 16, torch.float32, "cpu")
    for tensors in kv_caches:  # junk everywhere, so only restored bytes can be right
        for tensor in tensors:
            tensor.copy_(1e4 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(99)))
    async with OffloadEngine(
        layout, DeviceKVView(layout, kv_caches), EngineConfig(cache_dir=str(cache_dir)), fingerprint=fingerprint
    ) as engine:
        hit = engine.lookup(consumer_ids)
        tables = _consumer_tables(layout, hit) if hit else None
        result = await engine.load(consumer_ids, hit, tables) if hit else None
        stats = engine.statistics()
        engine.check()
    return hit, tables, kv_caches, result, stats


# (blocks per chunk, MTP extra retained tokens R, tokens the consumer shares, expected hit)
CASES = [
    pytest.param(1, 0, PREFIX_TOKENS, PREFIX_TOKENS, id="p1-r0-aligned"),
    pytest.param(2, 3, PREFIX_TOKENS, PREFIX_TOKENS, id="p2-r3-mtp"),
    pytest.param(1, 0, 90, 80, id="p1-r0-shorter-shared-prefix"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("blocks_per_chunk, extra_retained, shared, expected_hit", CASES)
async def test_restored_window_decodes_like_a_full_recompute(
    model_dir, tmp_path, blocks_per_chunk, extra_retained, shared, expected_hit
):
    started = time.perf_counter()
    prefix, consumer_ids = _prompts(shared)
    prompts_path = tmp_path / "prompts.jsonl"
    prompts_path.write_text(json.dumps({"token_ids": prefix}) + "\n")
    cache_dir = tmp_path / "cache"
    geometry = dict(block_size=BLOCK, blocks_per_chunk=blocks_per_chunk, extra_retained_tokens=extra_retained)

    summary = await run_warmup(
        model_dir, prompts_path, cache_dir, progress=False, attn_implementation="eager", **geometry
    )
    assert summary.prompts == 1 and summary.skipped == 0 and summary.tokens == PREFIX_TOKENS
    assert summary.chunks_stored > 0 and summary.chunks_dropped == 0 and summary.chunks_not_durable == 0

    # A rerun finds every chunk on disk and skips the prompt without running the model.
    again = await run_warmup(
        model_dir, prompts_path, cache_dir, progress=False, attn_implementation="eager", **geometry
    )
    assert again.skipped == 1 and again.tokens == 0 and again.chunks_stored == 0
    assert again.fingerprint == summary.fingerprint

    # The consumer: a new model object, a fresh engine on the same directory.
    model = load_model(model_dir, attn_implementation="eager")
    config = model.config
    layout, layer_groups = layout_from_config(config, **geometry)
    assert [g.sliding_window for g in layout.groups] == [None, WINDOW]
    hit, tables, kv_caches, result, stats = await _restore(
        model_dir, cache_dir, layout, layer_groups, config, consumer_ids
    )
    assert hit == expected_hit
    assert result.ok, result
    assert result.chunks_from_disk > 0 and result.chunks_from_host == 0  # nothing was on this host
    swa = layout.groups[1]
    start, end = retained_interval(swa, hit)
    assert (start, end) == (hit - (WINDOW - 1 + extra_retained), hit)
    assert tables[1][: start // BLOCK] == [NULL_BLOCK] * (start // BLOCK)

    # Every restored block equals the producer's, bit for bit.
    producer_kv = capture_kv(model, prefix)
    producer_tables = [list(range(len(t))) for t in tables]
    producer_blocks = allocate_kv_blocks(config, layout, layer_groups, len(tables[0]), torch.float32, "cpu")
    write_kv_to_blocks(producer_kv, producer_blocks, layer_groups, producer_tables, hit)
    restored = set(result.loaded)
    expected_blocks = {(0, b) for b in range(hit // BLOCK)} | {(1, b) for b in range(start // BLOCK, hit // BLOCK)}
    assert restored == expected_blocks
    for g, logical in sorted(restored):
        for j in range(len(layer_groups[g])):
            assert torch.equal(kv_caches[g][j][tables[g][logical]], producer_blocks[g][j][logical]), (g, logical, j)
    # And reading the restored positions back gives the producer's K/V exactly.
    readback = read_kv_from_blocks(kv_caches, layer_groups, tables, hit)
    for layer, ((k, v), (pk, pv)) in enumerate(zip(readback, producer_kv)):
        first = 0 if layer in layer_groups[0] else start
        assert torch.equal(k[:, first:], pk[:, first:hit]) and torch.equal(v[:, first:], pv[:, first:hit])

    # Decode from the restored blocks alone: sliding layers get junk before their retained interval.
    reference = full_logits(model, consumer_ids)
    junk = torch.Generator().manual_seed(5)
    cache = build_cache_from_blocks(config, kv_caches, layer_groups, tables, layout, hit, generator=junk)
    logits = next_token_logits(model, cache, consumer_ids, hit)
    diff = (logits - reference).abs().max().item()
    print(
        f"\nreal-model end-to-end (p={blocks_per_chunk}, R={extra_retained}): hit {hit} tokens, next-token "
        f"logits max abs diff {diff:.3e} (tolerance {TOLERANCE}), logits std {reference.std().item():.3f}"
    )
    assert diff <= TOLERANCE
    assert reference.std().item() > 0.1  # the logits carry signal: a match is not trivial

    # Negative controls: the test can fail. The first position the next token attends to in a
    # sliding layer is H - (W - 1) (the R older tokens are kept for MTP, not attended).
    first_attended = hit - (WINDOW - 1)
    logical = first_attended // BLOCK
    block = tables[1][logical]
    saved = [t[block].clone() for t in kv_caches[1]]

    def decode_moves() -> float:
        cache = build_cache_from_blocks(config, kv_caches, layer_groups, tables, layout, hit, generator=junk)
        return (next_token_logits(model, cache, consumer_ids, hit) - reference).abs().max().item()

    # 1. One block less of the window: the block holding the first attended position is junk.
    for tensor in kv_caches[1]:
        tensor[block] = 1e4 * torch.randn(tensor[block].shape, generator=junk)
    assert decode_moves() > 1e-2
    # 2. At the token: junk at the first attended position moves the logits; junk one position
    #    earlier (outside the window, inside the same block) does not.
    offset = first_attended % BLOCK
    assert offset > 0
    for position, should_move in ((offset, True), (offset - 1, False)):
        for tensor, good in zip(kv_caches[1], saved):
            tensor[block] = good
            tensor[block, :, position] = 1e4 * torch.randn(tensor[block, :, position].shape, generator=junk)
        moved = decode_moves()
        assert (moved > 1e-2) if should_move else (moved <= TOLERANCE), (position, moved)

    assert stats["chunks_on_disk"] >= summary.chunks_stored
    assert time.perf_counter() - started < 60


@pytest.mark.asyncio
async def test_warmup_resumes_a_grown_corpus(model_dir, tmp_path):
    generator = torch.Generator().manual_seed(11)
    system = torch.randint(3, 128, (64,), generator=generator).tolist()
    prompts = [system + torch.randint(3, 128, (n,), generator=generator).tolist() for n in (40, 20, 70)]
    short = [5, 6, 7]  # shorter than one chunk: nothing to store
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"token_ids": ids}) + "\n" for ids in prompts[:2] + [short]))
    cache_dir = tmp_path / "cache"

    first = await run_warmup(model_dir, corpus, cache_dir, progress=False)
    assert (first.prompts, first.skipped, first.tokens) == (3, 1, 104 + 84)
    assert first.chunks_present > 0  # the second prompt found the shared system prompt's chunks

    with corpus.open("a") as f:
        f.write(json.dumps({"token_ids": prompts[2]}) + "\n")
    second = await run_warmup(model_dir, corpus, cache_dir, progress=False)
    assert (second.prompts, second.skipped, second.tokens) == (4, 3, 134)
    assert second.chunks_stored > 0 and second.chunks_present > 0

    third = await run_warmup(model_dir, corpus, cache_dir, progress=False)
    assert (third.skipped, third.tokens, third.chunks_stored) == (4, 0, 0)


@pytest.mark.asyncio
async def test_warmup_tokenizes_text_prompts(model_dir, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    with_tokenizer = tmp_path / "model"
    shutil.copytree(model_dir, with_tokenizer)
    words = [f"w{i}" for i in range(100)]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.save_pretrained(with_tokenizer)
    text = " ".join(words[i % 100] for i in range(40))
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text(json.dumps({"text": text}) + "\n")

    summary = await run_warmup(with_tokenizer, corpus, tmp_path / "cache", progress=False)
    ids = tokenizer(text)["input_ids"]
    assert summary.tokens == len(ids) == 40 and summary.chunks_stored > 0
    config = transformers.AutoConfig.from_pretrained(with_tokenizer)
    layout, layer_groups = layout_from_config(config)
    kv_caches = allocate_kv_blocks(config, layout, layer_groups, 8, torch.float32, "cpu")
    async with OffloadEngine(
        layout,
        DeviceKVView(layout, kv_caches),
        EngineConfig(cache_dir=str(tmp_path / "cache")),
        fingerprint=model_fingerprint(config, layout, "float32"),
    ) as engine:
        assert engine.lookup(ids + [1]) == 32


@pytest.mark.asyncio
async def test_a_different_salt_or_model_misses(model_dir, tmp_path):
    prefix, consumer_ids = _prompts()
    prompts_path = tmp_path / "prompts.jsonl"
    prompts_path.write_text(json.dumps({"token_ids": prefix}) + "\n\n")
    cache_dir = tmp_path / "cache"
    summary = await run_warmup(model_dir, prompts_path, cache_dir, progress=False, salt="tenant-a")
    assert summary.chunks_stored > 0
    config = transformers.AutoConfig.from_pretrained(model_dir)
    layout, layer_groups = layout_from_config(config)
    kv_caches = allocate_kv_blocks(config, layout, layer_groups, 8, torch.float32, "cpu")
    fingerprint = model_fingerprint(config, layout, "float32")
    other_model = model_fingerprint(config, layout, "float32", weights_version="retrained")
    assert other_model != fingerprint
    async with OffloadEngine(
        layout, DeviceKVView(layout, kv_caches), EngineConfig(cache_dir=str(cache_dir)), fingerprint=fingerprint
    ) as engine:
        assert engine.lookup(consumer_ids, salt="tenant-a") == PREFIX_TOKENS
        assert engine.lookup(consumer_ids, salt="tenant-b") == 0
        assert engine.lookup(consumer_ids) == 0
    async with OffloadEngine(
        layout, DeviceKVView(layout, kv_caches), EngineConfig(cache_dir=str(cache_dir)), fingerprint=other_model
    ) as engine:
        assert engine.lookup(consumer_ids, salt="tenant-a") == 0


@pytest.mark.asyncio
async def test_warmup_reports_bad_prompts(model_dir, tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"token_ids": [1, 2]}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        await run_warmup(model_dir, bad_json, tmp_path / "c1", progress=False)
    text_only = tmp_path / "text.jsonl"
    text_only.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="tokenizer"):
        await run_warmup(model_dir, text_only, tmp_path / "c2", progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        await run_warmup(tmp_path / "no-model", text_only, tmp_path / "c3", progress=False)
    out_of_vocab = tmp_path / "oov.jsonl"
    out_of_vocab.write_text(json.dumps({"token_ids": [1] * 20 + [500]}) + "\n")  # past one chunk: checked after it
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await run_warmup(model_dir, out_of_vocab, tmp_path / "c4", progress=False)


def test_layout_from_gemma3_config():
    config = _gemma3_config(num_hidden_layers=6, layer_types=None)  # transformers' default pattern
    layout, layer_groups = layout_from_config(config, block_size=16, blocks_per_chunk=2, extra_retained_tokens=3)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert layer_groups == [[5], [0, 1, 2, 3, 4]]
    full, sliding = layout.groups
    assert full == AttentionGroup(block_size=16, blocks_per_chunk=2)
    assert sliding == AttentionGroup(block_size=16, blocks_per_chunk=2, sliding_window=WINDOW, extra_retained_tokens=3)
    assert layout.alignment_tokens == 32


def test_layout_from_mistral_and_llama_configs():
    mistral = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=48,
    )
    layout, layer_groups = layout_from_config(mistral, block_size=8)
    assert layout.groups == (AttentionGroup(block_size=8, sliding_window=48),)
    assert layer_groups == [[0, 1, 2]]

    mistral_full = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=None,
    )
    layout, layer_groups = layout_from_config(mistral_full)
    assert layout.groups == (AttentionGroup(block_size=16),) and layer_groups == [[0, 1]]

    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    layout, layer_groups = layout_from_config(llama)
    assert layout.groups == (AttentionGroup(block_size=16),) and layer_groups == [[0, 1]]


def test_layout_from_config_rejects_what_it_cannot_cache():
    with pytest.raises(ValueError, match="layer types"):
        layout_from_config(_gemma3_config(layer_types=["sliding_attention", "chunked_attention"] * 2))
    with pytest.raises(ValueError, match="bidirectional"):
        layout_from_config(_gemma3_config(use_bidirectional_attention=True))

    class Bare:
        model_type = "bare"

    with pytest.raises(ValueError, match="num_hidden_layers"):
        layout_from_config(Bare())
