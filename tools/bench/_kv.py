"""The KV bytes and paged layout the staging, tier and engine figures use, and the copy limits."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch

from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.device import DeviceKVView

from ._settings import BATCH_BYTES, BLOCK_TOKENS, BLOCK_UNIT, HEAD_DIM, LAYERS, mb_s

__all__ = ["KVGeometry", "make_kv_bytes", "measure_memcpy", "measure_piece_copy", "measure_staging"]


@dataclass(frozen=True)
class KVGeometry:
    """The paged KV layout the staging and engine figures use for one chunk size: a single
    full-attention group of ``LAYERS`` bf16 layers, blocks of ``[2, 16, heads, 128]``,
    ``blocks_per_chunk`` blocks per chunk."""

    chunk_bytes: int
    blocks_per_chunk: int
    heads: int

    @classmethod
    def for_chunk(cls, chunk_bytes: int) -> "KVGeometry":
        if chunk_bytes % BLOCK_UNIT:
            raise ValueError(f"chunk size {chunk_bytes} must be a multiple of {BLOCK_UNIT} bytes")
        units = chunk_bytes // BLOCK_UNIT  # heads x blocks_per_chunk
        blocks = 1
        while units // blocks > 8 and units % (blocks * 2) == 0:
            blocks *= 2  # keep 8 heads where possible, more blocks per chunk beyond that
        return cls(chunk_bytes, blocks, units // blocks)

    @property
    def layout(self) -> ModelLayout:
        return ModelLayout(groups=(AttentionGroup(BLOCK_TOKENS, blocks_per_chunk=self.blocks_per_chunk),))

    @property
    def tokens_per_chunk(self) -> int:
        return BLOCK_TOKENS * self.blocks_per_chunk

    def device_view(self, kv: torch.Tensor, num_chunks: int) -> DeviceKVView:
        """Layer tensors ``[num_blocks, 2, 16, heads, 128]`` that are views of ``kv`` (bf16)."""
        num_blocks = num_chunks * self.blocks_per_chunk
        shape = (LAYERS, num_blocks, 2, BLOCK_TOKENS, self.heads, HEAD_DIM)
        need = 1
        for d in shape:
            need *= d
        layers = kv[:need].view(shape)
        return DeviceKVView(self.layout, [[layers[i] for i in range(LAYERS)]])

    def block_ids(self, chunk: int) -> List[int]:
        first = chunk * self.blocks_per_chunk
        return list(range(first, first + self.blocks_per_chunk))


def make_kv_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    """``nbytes`` of bf16 ``randn`` (KV-like: high bytes compress, low bytes barely)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 2, dtype=torch.bfloat16, generator=generator)


def measure_memcpy(src: torch.Tensor, chunk_bytes: int, dst: torch.Tensor, repeats: int = 2) -> float:
    """MB/s of copying ``src`` (uint8) chunk by chunk into the preallocated ``dst``; best of runs."""
    n = src.numel() // chunk_bytes
    pairs = [(dst[i * chunk_bytes : (i + 1) * chunk_bytes], src[i * chunk_bytes : (i + 1) * chunk_bytes]) for i in range(n)]
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        for d, s in pairs:
            d.copy_(s)
        best = max(best, mb_s(n * chunk_bytes, time.perf_counter() - started))
    return best


def measure_piece_copy(kv: torch.Tensor, geometry: KVGeometry, num_chunks: int, dst: torch.Tensor,
                       repeats: int = 1) -> float:
    """MB/s of the copies staging cannot avoid: per chunk, one copy per layer of that layer's
    ``blocks_per_chunk`` blocks (numpy, slices made before the clock) into a preallocated buffer.
    Its ratio to ``memcpy`` is what the layer-major paged layout costs before any kvtier code runs."""
    shape = (LAYERS, num_chunks * geometry.blocks_per_chunk, 2, BLOCK_TOKENS, geometry.heads, HEAD_DIM)
    count = 1
    for d in shape:
        count *= d
    layers = kv[:count].view(torch.int16).numpy().reshape(shape)
    host = dst[: num_chunks * geometry.chunk_bytes].numpy().view(np.int16).reshape(
        (num_chunks, LAYERS, geometry.blocks_per_chunk) + shape[2:]
    )
    p = geometry.blocks_per_chunk
    pairs = [(host[c, li], layers[li, c * p : (c + 1) * p]) for c in range(num_chunks) for li in range(LAYERS)]
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        for d, s in pairs:
            np.copyto(d, s)
        best = max(best, mb_s(num_chunks * geometry.chunk_bytes, time.perf_counter() - started))
    return best


def measure_staging(view: DeviceKVView, geometry: KVGeometry, slots: Sequence[torch.Tensor], repeats: int = 2) -> float:
    """MB/s of ``gather_many_groups`` of every chunk into its host slot, 64 MiB per call."""
    per_call = max(1, BATCH_BYTES // geometry.chunk_bytes)
    items = [(0, geometry.block_ids(c), slot) for c, slot in enumerate(slots)]
    batches = [items[i : i + per_call] for i in range(0, len(items), per_call)]
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        for batch in batches:
            view.gather_many_groups(batch)
        best = max(best, mb_s(len(items) * geometry.chunk_bytes, time.perf_counter() - started))
    return best
