"""Figures that need no disk: ``longest_hit`` speed, SWA coverage against a brute-force minimal set,
and compression of real bf16 KV of a tiny random-init Gemma3 (built from a config, no download)."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Dict, List, Set

import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout, longest_hit
from kvtier.policy.hit import ChunkState
from kvtier.policy.plan import store_chunk_indices
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.record_format import CodecConfig, decode_record, encode_record

from ._settings import COVERAGE_TOKEN_BYTES, COVERAGE_TOKENS, LONGEST_HIT_TOKENS, mb_s

__all__ = [
    "deepseek_v4_like_layout",
    "measure_longest_hit",
    "measure_coverage",
    "gemma3_kv_bytes",
    "measure_compression",
]


def deepseek_v4_like_layout(extra_retained_tokens: int) -> ModelLayout:
    """Full attention 64-token blocks x 4 per chunk; SWA 64-token blocks, window 128; SWA 8-token
    blocks, window 128; MTP extra retained tokens ``R`` on both SWA groups."""
    r = extra_retained_tokens
    return ModelLayout(
        groups=(
            AttentionGroup(64, blocks_per_chunk=4),
            AttentionGroup(64, sliding_window=128, extra_retained_tokens=r),
            AttentionGroup(8, sliding_window=128, extra_retained_tokens=r),
        )
    )


def measure_longest_hit(tokens: int = LONGEST_HIT_TOKENS, repeats: int = 5) -> Dict[str, float]:
    """Median ms of ``longest_hit`` on a ``tokens``-token request over the 3-group layout (R = 3),
    with what a producer of the same prompt stored (pruned SWA chunks): a full hit, and a prompt
    that diverges at 100000 tokens (every chunk past it missing)."""
    layout = deepseek_v4_like_layout(3)
    stored = [set(store_chunk_indices(layout, g, tokens)) for g in range(len(layout.groups))]
    figures: Dict[str, float] = {}
    for name, diverge in (("full", tokens), ("diverging", min(tokens, 100_000))):
        ready = [
            {c for c in chunks if (c + 1) * g.tokens_per_chunk <= diverge}
            for chunks, g in zip(stored, layout.groups)
        ]

        def state(group: int, chunk: int, ready=ready) -> ChunkState:
            return ChunkState.READY if chunk in ready[group] else ChunkState.MISSING

        hit = longest_hit(layout, tokens, state)
        times = []
        for _ in range(repeats):
            loops = 0
            started = time.perf_counter()
            while True:
                longest_hit(layout, tokens, state)
                loops += 1
                elapsed = time.perf_counter() - started
                if elapsed > 0.05:
                    break
            times.append(elapsed / loops)
        figures[name] = statistics.median(times) * 1e3
        figures[f"{name}_hit"] = float(hit or 0)
    return figures


def _brute_force_minimal(layout: ModelLayout, group_index: int, num_tokens: int, *, cross_group: bool) -> Set[int]:
    """Chunks of an SWA group a producer of ``num_tokens`` must store, token by token: the union,
    over every reachable boundary H (each multiple of ``alignment_tokens`` and the group's final
    complete-block boundary), of the chunks holding a token of ``[H - (W - 1 + R), H)``; a boundary
    counts only if every chunk it touches is complete. ``cross_group``: H must also be servable by
    every other group (all of their chunks it needs complete), the stricter reading."""
    group = layout.groups[group_index]
    if group.sliding_window is None:
        raise ValueError(f"group {group_index} is full attention: only a sliding-window group has a minimal set")
    span = group.sliding_window - 1 + group.extra_retained_tokens
    tpc = group.tokens_per_chunk
    boundaries = set(range(layout.alignment_tokens, num_tokens + 1, layout.alignment_tokens))
    final = (num_tokens // group.block_size) * group.block_size
    if final:
        boundaries.add(final)

    def servable(g: AttentionGroup, h: int) -> bool:
        return h <= (num_tokens // g.tokens_per_chunk) * g.tokens_per_chunk

    chunks: Set[int] = set()
    for h in sorted(boundaries):
        touched = {t // tpc for t in range(max(0, h - span), h)}
        if not servable(group, h):
            continue
        if cross_group and not all(servable(g, h) for g in layout.groups):
            continue
        chunks |= touched
    return chunks


async def measure_coverage(extra_retained_tokens: int, num_tokens: int = COVERAGE_TOKENS, seed: int = 0) -> Dict[str, Any]:
    """Store a ``num_tokens`` prompt through an ``OffloadEngine`` (host only, no copies worth
    mentioning) on the DeepSeek-V4-like layout and compare the SWA chunks it schedules with
    storing every chunk and with the brute-force minimal set. Bytes at ``COVERAGE_TOKEN_BYTES``
    per token and group."""
    layout = deepseek_v4_like_layout(extra_retained_tokens)
    # Every chunk 2 KiB on the device, so the proportional host split gives each group the same
    # slot count (the figures count bytes at COVERAGE_TOKEN_BYTES per token, not these).
    caches = []
    for g in layout.groups:
        width = 2048 // (2 * 2 * g.tokens_per_chunk)
        caches.append([torch.zeros(num_tokens // g.block_size + 2, 2, g.block_size, 1, width, dtype=torch.bfloat16)])
    view = DeviceKVView(layout, caches)
    slots = num_tokens // min(g.tokens_per_chunk for g in layout.groups) + 8
    config = EngineConfig(host_capacity_bytes=slots * 2048 * len(layout.groups), store_queue_max_chunks=1 << 20)
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 32000) for _ in range(num_tokens)]
    tables = [list(range(1, num_tokens // g.block_size + 1)) for g in layout.groups]
    async with OffloadEngine(layout, view, config, fingerprint=b"kvtier-bench-coverage", pressure_sources={}) as engine:
        handle = engine.store(tokens, tables)
        await handle.wait_released()
        if handle.dropped:
            raise RuntimeError(f"coverage bench: the engine dropped {len(handle.dropped)} chunks ({handle.drop_reason})")
        scheduled: List[Set[int]] = [set() for _ in layout.groups]
        for group_index, chunk in handle.scheduled:
            scheduled[group_index].add(chunk)
    out: Dict[str, Any] = {"stored": 0, "every": 0, "minimal": 0, "cross_group": 0, "equal": True, "diff": []}
    for gi, group in enumerate(layout.groups):
        if group.sliding_window is None:
            continue
        chunk_bytes = group.tokens_per_chunk * COVERAGE_TOKEN_BYTES
        minimal = _brute_force_minimal(layout, gi, num_tokens, cross_group=False)
        cross = _brute_force_minimal(layout, gi, num_tokens, cross_group=True)
        out["stored"] += len(scheduled[gi]) * chunk_bytes
        out["every"] += (num_tokens // group.tokens_per_chunk) * chunk_bytes
        out["minimal"] += len(minimal) * chunk_bytes
        out["cross_group"] += len(cross) * chunk_bytes
        if scheduled[gi] != minimal:
            out["equal"] = False
            out["diff"].append(
                f"group {gi}: engine stores {sorted(scheduled[gi] - minimal)[:8]} beyond the minimal set "
                f"and misses {sorted(minimal - scheduled[gi])[:8]}"
            )
    return out


# ------------------------------------------------------------------------------------- compression


def gemma3_kv_bytes(seq_len: int, seed: int = 0) -> torch.Tensor:
    """KV bytes (uint8) of one forward pass of a tiny random-init Gemma3 in bf16, every layer's K and
    V laid out ``[seq, kv_heads, head_dim]`` as a paged cache holds them."""
    import transformers

    from kvtier.integrations.transformers import capture_kv, tiny_hybrid_config

    config = tiny_hybrid_config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=128,
        max_position_embeddings=max(4096, seq_len),
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(seed))
    parts = []
    for keys, values in capture_kv(model, ids.tolist()):
        for t in (keys, values):
            parts.append(t.transpose(0, 1).contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


def measure_compression(kv_u8: torch.Tensor, chunk_bytes: int, repeats: int = 3) -> Dict[str, float]:
    """zstd byte planes (the record codec, level 1) on ``kv_u8`` cut into chunks: stored ratio,
    encode and decode MB/s on one thread (best of ``repeats``), and plain zstd level 1's ratio."""
    import zstandard

    n = kv_u8.numel() // chunk_bytes
    if n == 0:
        raise ValueError("not enough KV bytes for one chunk")
    chunks = [kv_u8[i * chunk_bytes : (i + 1) * chunk_bytes].numpy().data for i in range(n)]
    meta = ChunkMeta(b"kvtier-bench", 0, 0, "bfloat16", (chunk_bytes // 2,))
    codec = CodecConfig()
    key = b"k" * 32
    enc_best = dec_best = 0.0
    records: List[bytes] = []
    out = bytearray(chunk_bytes)
    for _ in range(repeats):
        started = time.perf_counter()
        records = [encode_record(key, meta, c, codec) for c in chunks]
        enc_best = max(enc_best, mb_s(n * chunk_bytes, time.perf_counter() - started))
        started = time.perf_counter()
        for r in records:
            decode_record(key, r, out)
        dec_best = max(dec_best, mb_s(n * chunk_bytes, time.perf_counter() - started))
    plain = zstandard.ZstdCompressor(level=1)
    plain_bytes = sum(len(plain.compress(c)) for c in chunks)
    return {
        "ratio": n * chunk_bytes / sum(len(r) for r in records),
        "encode_mb_s": enc_best,
        "decode_mb_s": dec_best,
        "plain_ratio": n * chunk_bytes / plain_bytes,
    }
