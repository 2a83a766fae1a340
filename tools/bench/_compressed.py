"""Bytes a producer stores on DeepSeek-V4's real geometry, from the policy alone (no model run).

``deepseek_v4_store_figures``: per group of ``DeepseekV4CachePlan`` on transformers' default
``DeepseekV4Config`` (the V4-Flash geometry: 43 layers, 20 CSA rate 4, 23 HCA rate 128, window
128, head_dim 512, index_head_dim 128), the bytes ``store_chunk_indices`` keeps at ``num_tokens``
against storing every complete chunk. Sliding K in bf16; compressed entries and CSA window-carry
state in float32, as transformers keeps them.
"""

from __future__ import annotations

from typing import List, TypedDict

from ._settings import COVERAGE_TOKENS

__all__ = ["StoreFigure", "deepseek_v4_store_figures"]


class StoreFigure(TypedDict):
    """One group's figure: bytes stored against every complete chunk, hits every ``alignment`` tokens."""

    group: str
    layers: int
    stored: int
    every: int
    alignment: int


def deepseek_v4_store_figures(
    extra_retained_tokens: int, blocks_per_chunk: int = 1, block_size: int = 64, num_tokens: int = COVERAGE_TOKENS
) -> List[StoreFigure]:
    """``[{"group": "sliding" | "entries r=4" | ..., "layers", "stored", "every"}]``, bytes."""
    import transformers

    from kvtier.integrations.transformers import DeepseekV4CachePlan

    plan = DeepseekV4CachePlan(
        transformers.DeepseekV4Config(),
        block_size=block_size,
        blocks_per_chunk=blocks_per_chunk,
        extra_retained_tokens=extra_retained_tokens,
    )
    return [
        {
            "group": row["role"].kind + (f" r={row['role'].rate}" if row["role"].rate else ""),
            "layers": row["layers"],
            "stored": row["stored"],
            "every": row["every"],
            "alignment": plan.layout.alignment_tokens,
        }
        for row in plan.store_bytes(num_tokens)
    ]
