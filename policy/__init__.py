"""kvtier.policy: the pure math of KV offload. No I/O, no torch, no asyncio.

Group geometry, chunk keys, the SWA/MTP coverage contract (one retained interval from which lookup
window, load window, allocation skip and store mask all derive) and the longest valid hit.
"""

from .coverage import (
    load_window_size_in_chunks,
    num_skipped_tokens,
    reachable_store_block_mask,
    retained_chunk_range,
    retained_interval,
    sliding_window_size_in_chunks,
    store_spec,
)
from .geometry import AttentionGroup, ModelLayout, cdiv
from .hit import ChunkState, longest_hit
from .keys import KEY_BYTES, KEY_FORMAT_VERSION, KeyChain, chunk_keys, layout_fingerprint

__all__ = [
    "AttentionGroup",
    "ModelLayout",
    "ChunkState",
    "retained_interval",
    "retained_chunk_range",
    "num_skipped_tokens",
    "sliding_window_size_in_chunks",
    "load_window_size_in_chunks",
    "reachable_store_block_mask",
    "store_spec",
    "longest_hit",
    "chunk_keys",
    "KeyChain",
    "KEY_FORMAT_VERSION",
    "layout_fingerprint",
    "KEY_BYTES",
    "cdiv",
]
