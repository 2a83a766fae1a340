"""One interface per cache family: ``StandardCachePlan`` (full-attention / sliding-window K/V per
token) and ``cache_plan``, which picks it or ``DeepseekV4CachePlan`` for a config.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple, Union

import torch

from ._common import BlockTables, LayerKV, text_config
from .blocks import allocate_kv_blocks, build_cache_from_blocks, write_kv_to_blocks
from .config import group_block_shapes, layout_from_config
from .deepseek_v4 import DeepseekV4CachePlan, is_compressed_attention
from .model import capture_kv, check_captured_shapes

__all__ = ["StandardCachePlan", "cache_plan"]


class StandardCachePlan:
    """Full-attention / sliding-window K/V per token (``layout_from_config``): the verbs warmup and
    tests use, the same as ``DeepseekV4CachePlan``'s (``layout``, ``layer_groups``,
    ``allocate``, ``capture``, ``write``, ``build_cache``, ``fingerprint_shapes``)."""

    def __init__(self, config: Any, *, block_size: int = 16, blocks_per_chunk: int = 1, extra_retained_tokens: int = 0):
        self.config = text_config(config)
        self.layout, self.layer_groups = layout_from_config(
            self.config, block_size=block_size, blocks_per_chunk=blocks_per_chunk, extra_retained_tokens=extra_retained_tokens
        )

    def fingerprint_shapes(self) -> List[Tuple[int, ...]]:
        """Per group ``(layers, *per-block shape without the block size)``: ``(layers, 2, heads,
        dim)`` as before per-group shapes existed, or ``(layers, heads, k_dim + v_dim)``."""
        shapes = group_block_shapes(self.config, self.layout, self.layer_groups)
        return [
            (len(layers), *(shape[:1] + shape[2:] if len(shape) == 4 else shape[1:]))
            for layers, shape in zip(self.layer_groups, shapes)
        ]

    def allocate(self, num_blocks, dtype: torch.dtype, device: Union[str, torch.device] = "cpu"):
        return allocate_kv_blocks(self.config, self.layout, self.layer_groups, num_blocks, dtype, device)

    def capture(self, model, token_ids: Sequence[int]) -> List[LayerKV]:
        kv = capture_kv(model, token_ids)
        check_captured_shapes(self.config, kv)
        return kv

    def write(self, captured: Sequence[LayerKV], kv_caches, block_tables: BlockTables, num_tokens: int) -> None:
        write_kv_to_blocks(captured, kv_caches, self.layer_groups, block_tables, num_tokens)

    def build_cache(self, model, kv_caches, block_tables: BlockTables, hit_tokens: int, **kwargs: Any):
        return build_cache_from_blocks(self.config, kv_caches, self.layer_groups, block_tables, self.layout, hit_tokens, **kwargs)


def cache_plan(config: Any, *, block_size: int = 16, blocks_per_chunk: int = 1, extra_retained_tokens: int = 0):
    """The cache plan of ``config``: ``DeepseekV4CachePlan`` for compressed attention, else
    ``StandardCachePlan``. Config-level refusals (shared KV, lossy cache modes, chunked attention)
    raise ``ValueError`` here, before any model is loaded."""
    geometry = dict(block_size=block_size, blocks_per_chunk=blocks_per_chunk, extra_retained_tokens=extra_retained_tokens)
    if is_compressed_attention(config):
        return DeepseekV4CachePlan(config, **geometry)
    return StandardCachePlan(config, **geometry)
