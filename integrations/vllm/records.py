"""The record meta ``KvtierTier`` binds to every chunk it stores (and an offline warmup must match).

A record's meta carries the layout fingerprint, vLLM's group id, the chunk index
(vLLM's end-token position of the offload key // the group's tokens per chunk; 0 when vLLM gave
no position) and the primary row as ``uint8[row_bytes]``. A load accepts a record only when these
agree, so the tier and ``model_warmup`` build them with this one function. Pure, any thread.
"""

from __future__ import annotations

from typing import Optional

from kvtier.engine.config import StoreConfig, codec_settings
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.record_format import CodecConfig

from .keys import VllmLayout

__all__ = ["ROW_DTYPE", "record_meta", "codec_for"]

ROW_DTYPE = "uint8"


def record_meta(layout: VllmLayout, group_id: int, end_token: Optional[int], row_bytes: int) -> ChunkMeta:
    """Meta of the record holding group ``group_id``'s chunk that ends at token ``end_token``."""
    tokens_per_chunk = next(
        (g.tokens_per_block * layout.blocks_per_chunk for g in layout.groups if g.group_id == group_id), 1
    )
    chunk_index = 0 if end_token is None else int(end_token) // tokens_per_chunk
    return ChunkMeta(fingerprint=layout.fingerprint, group_index=int(group_id), chunk_index=chunk_index,
                     dtype=ROW_DTYPE, shape=(int(row_bytes),))


def codec_for(compression: int) -> CodecConfig:
    """The record codec of the tier's ``compression`` setting (0: raw records, else the zstd level):
    the codec of the tier's store settings, so the offline warmup writes what the tier reads."""
    return StoreConfig(**codec_settings(compression)).codec_config()
