"""Offline warmup from a transformers model: vLLM's CPU primary rows built from the model's own K/V.

``warm_from_kv`` takes a ``capture`` callable that runs a local causal LM over one prompt (the
``kvtier warmup`` hook passes ``kvtier.integrations.transformers.capture_kv``: every layer's post-RoPE K/V, what an
attention kernel caches; imports flow tools -> integrations, so the model is loaded there) and writes, under the keys a vLLM server
with ``KvtierTier`` computes (``warmup.vllm_chunk_keys``: vLLM's hasher, NONE_HASH, cache_salt),
records byte-identical to the ones that server's tier would write: one primary row per chunk,
meta from ``records.record_meta``, the same codec, in the cache dir's LMDB tier.

How a row is laid out (vLLM 0.33, read from its code):
- a layer's page for one block is the block's ``[H, N, C]`` cell of the per-layer view
  ``[B, H, N, C]`` (``kv_cache_interface.create_kv_cache_views``) in the physical order of the
  resolved ``KVCacheLayout``: ``LBNHC`` (alias NHD) stores tokens-major ``[N, H, C]``, ``LBHNC``
  (alias HND) heads-major ``[H, N, C]``; ``C`` is K then V in the cache dtype (the attention
  backends split it with ``.split(head_size, dim=-1)``). Block-outermost layouts (``BL*``) pack
  all layers per block and ``LHBNC`` is not block-contiguous: refused.
- the CPU row of a chunk is the canonical tensors' regions back to back, one per offloaded layer
  in group order then layer order (``OffloadingConnectorWorker.register_kv_caches``,
  ``SharedOffloadRegion.create_next_worker_view``), each ``blocks_per_chunk`` pages long; a
  chunk of group g fills only g's layers' regions (the others keep stale bytes in a server's
  slab; zeros here).
- which chunks vLLM stores per group: every complete chunk of a full-attention group, and for a
  sliding-window group those ``policy.retention.retention_store_chunk_indices`` gives for the
  boundaries vLLM retains under the server's ``prefix_cache_retention_interval`` (``_stored_chunks``;
  tests/integration/test_vllm_model_warmup.py compares them with vLLM's own stores).

Runs on the caller's thread (the model's); the LMDB writes run on a private event loop.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.policy.retention import check_retention_interval, retention_store_chunk_indices
from kvtier.tiers.lmdb import LmdbTier

from .keys import VllmLayout
from .records import codec_for, record_meta
from .warmup import VllmKeySchemeError, vllm_chunk_keys

__all__ = ["VllmRowLayout", "warm_from_kv", "ModelWarmupSummary", "block_page", "page_order", "PAGE_ORDERS"]

# resolved KVCacheLayout name -> order of one block's page ("NHC": tokens-major, "HNC": heads-major)
PAGE_ORDERS = {"LBNHC": "NHC", "NHD": "NHC", "LBHNC": "HNC", "HND": "HNC"}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def block_page(keys: torch.Tensor, values: torch.Tensor, start: int, tokens: int, page_order: str,
               dtype: torch.dtype) -> bytes:
    """One layer's page bytes for tokens ``[start, start + tokens)``; ``keys``/``values`` are
    ``[num_kv_heads, seq, head_dim]`` as ``capture_kv`` returns them."""
    cell = torch.cat([keys[:, start : start + tokens], values[:, start : start + tokens]], dim=-1).to(dtype)
    if page_order == "NHC":
        cell = cell.transpose(0, 1)
    return cell.contiguous().view(torch.uint8).numpy().tobytes()


def page_order(layout: VllmLayout, kv_cache_layout: Optional[str]) -> str:
    """``NHC`` or ``HNC`` for the server's resolved KV cache layout; refuses what offline rows cannot
    reproduce (checked before any model is loaded or byte written)."""
    name = layout.kv_cache_layout or kv_cache_layout
    if name is None:
        raise VllmKeySchemeError(
            "the vLLM layout does not record the resolved KV cache layout (kv_cache_layout is null); "
            "pass --vllm-kv-cache-layout (LBNHC/NHD or LBHNC/HND, the server's VLLM_KV_CACHE_LAYOUT)"
        )
    if layout.kv_cache_layout and kv_cache_layout and PAGE_ORDERS.get(kv_cache_layout) != PAGE_ORDERS.get(layout.kv_cache_layout):
        raise VllmKeySchemeError(
            f"--vllm-kv-cache-layout {kv_cache_layout!r} contradicts the layout file's {layout.kv_cache_layout!r}")
    if name not in PAGE_ORDERS:
        raise VllmKeySchemeError(
            f"KV cache layout {name!r} is not supported offline: only layer-compact, block-contiguous "
            f"layouts ({', '.join(sorted(PAGE_ORDERS))}) give one page per layer and block")
    if dict(layout.parallel).get("world_size", 1) != 1 or layout.canonical_layout or layout.replicated_layout:
        raise VllmKeySchemeError(
            f"offline warmup builds single-worker rows; this layout has parallel={dict(layout.parallel)}, "
            f"canonical_layout={layout.canonical_layout}, replicated_layout={layout.replicated_layout}")
    return PAGE_ORDERS[name]


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise VllmKeySchemeError(f"the vLLM layout's dtype {name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True)
class VllmRowLayout:
    """Where each offloaded layer's pages sit in a primary row, for one model and vLLM layout."""

    layout: VllmLayout
    page_order: str
    dtype: torch.dtype
    model_layers: Dict[str, int]  # vLLM layer name -> model layer index
    region_offsets: Dict[str, int]  # vLLM layer name -> byte offset of its region in the row
    page_bytes: Dict[str, int]

    @classmethod
    def build(cls, layout: VllmLayout, layer_shapes: Sequence[Tuple[int, int, int]],
              kv_cache_layout: Optional[str]) -> "VllmRowLayout":
        """``layer_shapes``: per model layer ``(num_kv_heads, k_dim, v_dim)``."""
        dtype = _dtype_of(layout.dtype)
        shapes = list(layer_shapes)
        model_layers: Dict[str, int] = {}
        offsets: Dict[str, int] = {}
        pages: Dict[str, int] = {}
        offset = 0
        for group in layout.groups:
            for layer_name in group.layer_names:
                match = _LAYER_INDEX.search(layer_name)
                if match is None or int(match.group(1)) >= len(shapes):
                    raise VllmKeySchemeError(
                        f"vLLM layer {layer_name!r} names no layer of the model ({len(shapes)} layers)")
                if layer_name in offsets:
                    raise VllmKeySchemeError(f"vLLM layer {layer_name!r} is in two groups (aliased pages)")
                heads, k_dim, v_dim = shapes[int(match.group(1))]
                model_layers[layer_name] = int(match.group(1))
                pages[layer_name] = heads * group.tokens_per_block * (k_dim + v_dim) * dtype.itemsize
                offsets[layer_name] = offset
                offset += pages[layer_name] * layout.blocks_per_chunk
        if offset != layout.primary_row_bytes:
            raise VllmKeySchemeError(
                f"the model's KV geometry gives {offset}-byte rows but the vLLM layout's rows are "
                f"{layout.primary_row_bytes} bytes: another model, dtype or KV layout than the server's")
        return cls(layout, page_order(layout, kv_cache_layout), dtype, model_layers, offsets, pages)

    def chunk_row(self, kv: Sequence[Tuple[torch.Tensor, torch.Tensor]], group_id: int, chunk_index: int) -> bytearray:
        """The primary row vLLM's CPU tier holds for ``group_id``'s chunk ``chunk_index``."""
        group = self.layout.groups[self.layout.group_index(group_id)]
        row = bytearray(self.layout.primary_row_bytes)
        tokens = group.tokens_per_block
        for layer_name in group.layer_names:
            keys, values = kv[self.model_layers[layer_name]]
            at = self.region_offsets[layer_name]
            for j in range(self.layout.blocks_per_chunk):
                block = chunk_index * self.layout.blocks_per_chunk + j
                page = block_page(keys, values, block * tokens, tokens, self.page_order, self.dtype)
                row[at + j * len(page) : at + (j + 1) * len(page)] = page
        return row


def _store_layout(layout: VllmLayout, types: Sequence[str], window: Optional[int], extra_retained_tokens: int) -> ModelLayout:
    """kvtier's view of the server's groups (block = vLLM block), for vLLM's store selection."""
    groups = []
    for group in layout.groups:
        kinds = {types[int(_LAYER_INDEX.search(n).group(1))] for n in group.layer_names}  # type: ignore[union-attr]
        if len(kinds) != 1:
            raise VllmKeySchemeError(f"vLLM group {group.group_id} mixes attention types {sorted(kinds)}")
        sliding = kinds.pop() != "full_attention"
        groups.append(AttentionGroup(block_size=group.tokens_per_block, blocks_per_chunk=layout.blocks_per_chunk,
                                     sliding_window=window if sliding else None,
                                     extra_retained_tokens=extra_retained_tokens if sliding else 0))
    return ModelLayout(groups=tuple(groups))


def _stored_chunks(store_layout: ModelLayout, index: int, num_tokens: int, retention_interval: Optional[int]) -> set:
    """The chunks of group ``index`` vLLM's producer of a ``num_tokens`` prompt stores.

    A full-attention group stores every complete chunk. A sliding-window group keeps state at the
    boundaries vLLM retains: ``None``, every boundary up to ``num_tokens``; otherwise the replay
    boundary ``num_tokens - 1`` (vLLM's ``replay_boundaries``: a resend recomputes its last token)
    plus, for ``k > 0``, every multiple of ``k`` up to ``num_tokens`` (computed tokens reach it).
    """
    group = store_layout.groups[index]
    if group.sliding_window is None:
        return set(range(num_tokens // (group.block_size * group.blocks_per_chunk)))
    if retention_interval is None:
        return set(retention_store_chunk_indices(store_layout, index, num_tokens, None))
    chunks = set(retention_store_chunk_indices(store_layout, index, num_tokens - 1, retention_interval))
    if retention_interval and num_tokens % retention_interval == 0:
        chunks |= set(retention_store_chunk_indices(store_layout, index, num_tokens, retention_interval))
    return chunks


@dataclass(frozen=True)
class ModelWarmupSummary:
    prompts: int
    chunks_stored: int
    chunks_present: int


def warm_from_kv(capture: Callable[[List[int]], Sequence[Tuple[torch.Tensor, torch.Tensor]]],
                 cache_dir: "os.PathLike[str] | str", layout: VllmLayout, prompts: Sequence[Sequence[int]], *,
                 layer_shapes: Sequence[Tuple[int, int, int]], layer_types: Sequence[str],
                 sliding_window: Optional[int], cache_salt: Optional[str] = None,
                 retention_interval: Optional[int] = 0, kv_cache_layout: Optional[str] = None,
                 extra_retained_tokens: int = 0, compression: int = 1) -> ModelWarmupSummary:
    """Fill ``cache_dir`` so a vLLM server with ``layout`` (and this model's weights) hits every
    chunk it would have stored for ``prompts``. ``capture(prompt)``: per model layer ``(K, V)``,
    each ``[num_kv_heads, len(prompt), head_dim]``; ``layer_shapes`` / ``layer_types`` /
    ``sliding_window``: the model's per-layer KV shape and attention type
    (``integrations.transformers.layer_kv_shapes`` / ``layer_types_from_config``). ``retention_interval``: the
    server's ``prefix_cache_retention_interval``; ``compression``: its ``KvtierTier`` compression."""
    rows = VllmRowLayout.build(layout, layer_shapes, kv_cache_layout)
    store_layout = _store_layout(layout, layer_types, sliding_window, extra_retained_tokens)
    check_retention_interval(store_layout, retention_interval)
    items: List[Any] = []
    for prompt in prompts:
        kv = [(k.float().cpu(), v.float().cpu()) for k, v in capture(list(prompt))]
        wanted = {group.group_id: _stored_chunks(store_layout, index, len(prompt), retention_interval)
                  for index, group in enumerate(layout.groups)}
        for key in vllm_chunk_keys(prompt, layout, cache_salt=cache_salt):
            if key.chunk_index in wanted[key.group_id]:
                meta = record_meta(layout, key.group_id, key.end_token, layout.primary_row_bytes)
                items.append((key.chunk_key, meta, rows.chunk_row(kv, key.group_id, key.chunk_index)))
    codec = codec_for(compression)

    async def put() -> Tuple[int, int]:
        tier = await LmdbTier.open(cache_dir, codec=codec, max_raw_bytes=max(layout.primary_row_bytes, 1 << 20))
        try:
            unique = list({key: (key, meta, memoryview(row)) for key, meta, row in items}.values())
            present = await tier.contains_many([key for key, _, _ in unique])
            fresh = [item for item, here in zip(unique, present) if not here]
            if fresh:
                await tier.put_many(fresh)
            return len(fresh), len(unique) - len(fresh)
        finally:
            await tier.close()

    stored, present = asyncio.run(put())
    _leave_layout_file(cache_dir, layout)
    return ModelWarmupSummary(len(prompts), stored, present)


def _leave_layout_file(cache_dir: "os.PathLike[str] | str", layout: VllmLayout) -> None:
    path = os.path.join(os.fspath(cache_dir), layout.file_name)
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as out:
            out.write(layout.to_json())
        os.replace(path + ".tmp", path)
