"""DeepSeek-V4 (transformers ``models/deepseek_v4``) seen as kvtier groups.

Every DeepSeek-V4 layer keeps a sliding window of shared K=V; compressed layers (CSA, rate 4; HCA,
rate 128) also keep compressed entries over the whole history, and CSA layers (compressor and
Lightning indexer) carry the per-token state of their last complete window into the next entry
(``overlap_kv`` / ``overlap_gate`` of ``DeepseekV4CSACache``). kvtier stores them as the groups of a
``CompressedAttentionLayout`` and restores only at multiples of every rate, where every compressor
buffer is empty (docs/ARCHITECTURE.md, "Compressed attention").

Per-layer block tensors (block index first), by group role:

- ``sliding``: ``[n, b, kv_heads, head_dim]`` in the model dtype (K = V, stored once);
- ``entries`` of rate ``r``: ``[n, e, head_dim (+ index_head_dim for CSA)]`` float32: the
  compressor's entries, then the indexer's (transformers keeps the compressors in float32);
- ``overlap`` of rate ``r``: ``[n, r, 2 * head_dim + 2 * index_head_dim]`` float32 per token:
  the compressor's window-carry K and gate (position bias added), then the indexer's.

Primitives (call from the model's thread): ``is_compressed_attention``, ``DeepseekV4CachePlan``
(``layout``, ``allocate``, ``capture``, ``write``, ``build_cache``, ``item_shapes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kvtier.policy import ModelLayout, cdiv
from kvtier.policy.plan import store_chunk_indices
from kvtier.policy.compressed import ENTRIES, OVERLAP, SLIDING, CompressedAttentionLayout, GroupRole

from ._common import BlockTables, positive_int, require_transformers, text_config, token_tensor, valid_block

__all__ = ["is_compressed_attention", "DeepseekV4CachePlan", "DeepseekV4Capture"]

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
_SLIDING = "sliding_attention"


def _rate(role: GroupRole) -> int:
    """The compression rate of an entries or overlap group; only a sliding group has none."""
    if role.rate is None:
        raise ValueError(f"an {role.kind!r} group without a compression rate")
    return role.rate


def is_compressed_attention(config: Any) -> bool:
    """Whether ``config`` is a compressed-attention model this module handles (DeepSeek-V4)."""
    config = text_config(config)
    return getattr(config, "model_type", None) == "deepseek_v4" or any(
        t in (CSA, HCA) for t in (getattr(config, "layer_types", None) or [])
    )


@dataclass
class DeepseekV4Capture:
    """One prompt's cache state, every position: per layer the sliding K ``[heads, n, dim]``;
    per compressed layer its entries ``[n // rate, width]``; per CSA layer the per-token overlap
    state ``[n, width]``."""

    num_tokens: int
    sliding: List[torch.Tensor]
    entries: Dict[int, torch.Tensor]
    overlap: Dict[int, torch.Tensor]


def _rows_to_blocks(rows: torch.Tensor, tensor: torch.Tensor, table: Sequence[Optional[int]], count: int) -> None:
    """Write rows ``[0, count)`` of ``rows`` (``[N, *item]``) into ``tensor`` (``[n, per_block,
    *item]``) through ``table``; the tail of a partial last block is zero-filled."""
    per_block = tensor.shape[1]
    num_blocks = cdiv(count, per_block)
    if len(table) < num_blocks:
        raise ValueError(f"block table has {len(table)} blocks, {count} rows need {num_blocks}")
    lossless = rows.dtype == tensor.dtype or (
        tensor.dtype == torch.float32 and rows.dtype in (torch.bfloat16, torch.float16)
    )
    if tuple(rows.shape[1:]) != tuple(tensor.shape[2:]) or not lossless:
        raise ValueError(
            f"rows {tuple(rows.shape[1:])} {rows.dtype} do not fit blocks of {tuple(tensor.shape[2:])} "
            f"{tensor.dtype} (only an exact widening to float32 is allowed)"
        )
    staged = torch.zeros(num_blocks * per_block, *rows.shape[1:], dtype=tensor.dtype, device=tensor.device)
    staged[:count] = rows[:count]
    staged = staged.view(num_blocks, per_block, *rows.shape[1:])
    for logical in range(num_blocks):
        block = table[logical]
        if valid_block(block):
            tensor[int(block)] = staged[logical]


def _blocks_to_rows(tensor: torch.Tensor, table: Sequence[Optional[int]], start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` read from ``tensor``'s blocks through ``table``: only the blocks holding
    them are read, and only those rows are returned. A missing block there is a ``ValueError``."""
    per_block = tensor.shape[1]
    parts = []
    for logical in range(start // per_block, cdiv(end, per_block)):
        block = table[logical] if logical < len(table) else None
        if not valid_block(block):
            raise ValueError(f"logical block {logical} holds rows of [{start}, {end}) but has no device block")
        lo = max(start, logical * per_block) - logical * per_block
        hi = min(end, (logical + 1) * per_block) - logical * per_block
        parts.append(tensor[int(block), lo:hi])
    return torch.cat(parts, dim=0)


class DeepseekV4CachePlan:
    """The kvtier layout of one DeepSeek-V4 config and the conversions to and from its cache.

    ``block_size`` is the sliding group's block (tokens); ``extra_retained_tokens`` is MTP's ``R``
    (it widens only the sliding group). Unsupported configs raise ``ValueError`` naming the field.
    """

    def __init__(self, config: Any, *, block_size: int = 16, blocks_per_chunk: int = 1, extra_retained_tokens: int = 0):
        config = text_config(config)
        self.config = config
        num_layers = positive_int(config, "num_hidden_layers")
        layer_types = list(getattr(config, "layer_types", None) or [])
        if len(layer_types) != num_layers:
            raise ValueError(f"unsupported model config (deepseek_v4): {len(layer_types)} layer_types for {num_layers} layers")
        unknown = sorted({t for t in layer_types if t not in (_SLIDING, CSA, HCA)})
        if unknown:
            raise ValueError(f"unsupported model config (deepseek_v4): layer types {unknown}")
        rates = dict(getattr(config, "compress_rates", None) or {})
        self.layer_types = layer_types
        self.rate_of = {i: int(rates[t]) for i, t in enumerate(layer_types) if t != _SLIDING}
        by_rate: Dict[int, set] = {}
        for i, rate in self.rate_of.items():
            by_rate.setdefault(rate, set()).add(layer_types[i])
        mixed = {r: sorted(t) for r, t in by_rate.items() if len(t) > 1}
        if mixed:
            raise ValueError(f"unsupported model config (deepseek_v4): CSA and HCA share a compression rate {mixed}")
        self.head_dim = positive_int(config, "head_dim")
        self.index_head_dim = positive_int(config, "index_head_dim")
        self.num_kv_heads = positive_int(config, "num_key_value_heads")
        window = positive_int(config, "sliding_window")
        if not self.rate_of:
            raise ValueError("unsupported model config (deepseek_v4): no compressed layer (plain sliding window)")
        self.spec = CompressedAttentionLayout(
            block_size=block_size,
            sliding_window=window,
            compress_rates=tuple(sorted(by_rate)),
            overlap_rates=tuple(sorted(r for r, t in by_rate.items() if CSA in t)),
            blocks_per_chunk=blocks_per_chunk,
            extra_retained_tokens=extra_retained_tokens,
        )
        self.layout: ModelLayout = self.spec.layout()
        self.roles: Tuple[GroupRole, ...] = self.spec.roles
        self.layer_groups: List[List[int]] = []
        for role in self.roles:
            if role.kind == SLIDING:
                self.layer_groups.append(list(range(num_layers)))
            elif role.kind == ENTRIES:
                self.layer_groups.append([i for i, r in self.rate_of.items() if r == role.rate])
            else:
                self.layer_groups.append([i for i, r in self.rate_of.items() if r == role.rate and layer_types[i] == CSA])

    # -- shapes ------------------------------------------------------------------------------------

    def _is_csa_rate(self, rate: int) -> bool:
        return rate in self.spec.overlap_rates

    def item_shapes(self) -> List[Tuple[int, ...]]:
        """Per group, one item's shape: a sliding token ``(heads, head_dim)``, an entry
        ``(width,)``, an overlap token ``(width,)``."""
        shapes: List[Tuple[int, ...]] = []
        for role in self.roles:
            if role.kind == SLIDING:
                shapes.append((self.num_kv_heads, self.head_dim))
            elif role.kind == ENTRIES:
                shapes.append((self.head_dim + (self.index_head_dim if self._is_csa_rate(_rate(role)) else 0),))
            else:
                shapes.append((2 * self.head_dim + 2 * self.index_head_dim,))
        return shapes

    def group_dtypes(self, dtype: torch.dtype) -> List[torch.dtype]:
        """The sliding K in the model dtype; compressor entries and carried state in float32: the
        compressors run in float32 or in the model dtype depending on how the model was loaded
        (``_keep_in_fp32_modules``), and the gate carry is float32 either way (float32 position
        bias). Widening bf16/fp16 to float32 is exact; ``build_cache`` casts back."""
        return [dtype if role.kind == SLIDING else torch.float32 for role in self.roles]

    def items_per_block(self, group_index: int) -> int:
        role, group = self.roles[group_index], self.layout.groups[group_index]
        return group.block_size // _rate(role) if role.kind == ENTRIES else group.block_size

    def fingerprint_shapes(self) -> List[Tuple[int, ...]]:
        """Per group ``(layers, role code, rate, *item shape)``: what a group's bytes mean."""
        codes = {SLIDING: 0, ENTRIES: 1, OVERLAP: 2}
        return [
            (len(layers), codes[role.kind], role.rate or 0, *shape)
            for role, layers, shape in zip(self.roles, self.layer_groups, self.item_shapes())
        ]

    def store_bytes(self, num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> List[Dict[str, Any]]:
        """Per group, what a producer of ``num_tokens`` stores (``store_chunk_indices``) against
        storing every complete chunk: ``{"role", "layers", "chunks", "stored", "every"}`` in bytes,
        computed from the policy alone (no model run)."""
        rows = []
        for g, (role, layers, shape, group_dtype) in enumerate(
            zip(self.roles, self.layer_groups, self.item_shapes(), self.group_dtypes(dtype))
        ):
            group = self.layout.groups[g]
            item_bytes = torch.Size(shape).numel() * torch.empty((), dtype=group_dtype).element_size()
            chunk_bytes = len(layers) * group.blocks_per_chunk * self.items_per_block(g) * item_bytes
            chunks = len(store_chunk_indices(self.layout, g, num_tokens))
            every = num_tokens // group.tokens_per_chunk
            rows.append(
                {"role": role, "layers": len(layers), "chunks": chunks, "stored": chunks * chunk_bytes, "every": every * chunk_bytes}
            )
        return rows

    def allocate(self, num_blocks: Union[int, Sequence[int]], dtype: torch.dtype, device: Union[str, torch.device] = "cpu"):
        """Zeroed block tensors, ``kv_caches[g][j]`` for layer ``layer_groups[g][j]``."""
        counts = [num_blocks] * len(self.roles) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(self.roles) or any(not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"num_blocks must be a positive int or one per group, got {num_blocks!r}")
        return [
            [torch.zeros(count, self.items_per_block(g), *shape, dtype=group_dtype, device=device) for _ in layers]
            for g, (layers, shape, count, group_dtype) in enumerate(
                zip(self.layer_groups, self.item_shapes(), counts, self.group_dtypes(dtype))
            )
        ]

    # -- producer ----------------------------------------------------------------------------------

    @torch.no_grad()
    def capture(self, model, token_ids: Sequence[int]) -> DeepseekV4Capture:
        """Run ``token_ids`` once through ``model`` with its own cache and record every position's
        sliding K (before the cache trims it to the window), every compressed entry, and every
        token's CSA window-carry state (the projections the cache's overlap is sliced from)."""
        transformers = require_transformers()
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        device = next(model.parameters()).device
        cache = transformers.DynamicCache(config=model.config)
        layers = model.model.layers
        sliding: Dict[int, torch.Tensor] = {}
        projections: Dict[Tuple[int, str, str], torch.Tensor] = {}
        hooks = []
        for index, layer_cache in enumerate(cache.layers):
            original = layer_cache.update

            def recording(key_states, value_states, *args, _index=index, _original=original, **kwargs):
                sliding[_index] = key_states[0].detach().clone()
                return _original(key_states, value_states, *args, **kwargs)

            layer_cache.update = recording
        for index, layer_type in enumerate(self.layer_types):
            if layer_type != CSA:
                continue
            compressor = layers[index].self_attn.compressor
            for name, module in (("compressor", compressor), ("indexer", compressor.indexer)):
                for proj in ("kv_proj", "gate_proj"):
                    hooks.append(
                        getattr(module, proj).register_forward_hook(
                            lambda _m, _i, out, key=(index, name, proj): projections.__setitem__(key, out[0].detach())
                        )
                    )
        try:
            model(input_ids=token_tensor(token_ids, device), use_cache=True, cache=cache)
        finally:
            for hook in hooks:
                hook.remove()
        n = len(token_ids)
        if sorted(sliding) != list(range(len(self.layer_types))):
            raise ValueError(f"the model updated cache layers {sorted(sliding)}, expected all {len(self.layer_types)}")
        entries: Dict[int, torch.Tensor] = {}
        overlap: Dict[int, torch.Tensor] = {}
        for index, rate in self.rate_of.items():
            layer_cache = cache.layers[index]
            names = ["compressor", "indexer"] if self.layer_types[index] == CSA else ["compressor"]
            parts = []
            for name in names:
                got = layer_cache.compressed_kv[name]
                if got is None or got.shape[1] != n // rate or layer_cache.entry_count[name] != n // rate:
                    raise ValueError(f"layer {index}: {name} holds {None if got is None else got.shape[1]} entries, expected {n // rate}")
                parts.append(got[0])
            entries[index] = torch.cat(parts, dim=-1)
            if self.layer_types[index] == CSA:
                attn = layers[index].self_attn.compressor
                state = []
                for name, module, dim in (("compressor", attn, self.head_dim), ("indexer", attn.indexer, self.index_head_dim)):
                    kv, gate = projections[index, name, "kv_proj"], projections[index, name, "gate_proj"]
                    # The cache's overlap is (gate.view(windows, rate, -1) + position_bias)[-1, :, :dim]:
                    # the same float32 add per token, so the stored state equals it bit for bit.
                    bias = module.position_bias[torch.arange(n, device=gate.device) % rate]
                    state += [kv[:, :dim].float(), (gate + bias)[:, :dim].float()]
                overlap[index] = torch.cat(state, dim=-1)
        return DeepseekV4Capture(
            num_tokens=n, sliding=[sliding[i].transpose(0, 1) for i in range(len(self.layer_types))], entries=entries, overlap=overlap
        )

    def write(self, captured: DeepseekV4Capture, kv_caches, block_tables: BlockTables, num_tokens: int) -> None:
        """Copy positions ``[0, num_tokens)`` (entries ``[0, num_tokens // rate)``) into the blocks;
        blocks without a device block are skipped."""
        if num_tokens > captured.num_tokens:
            raise ValueError(f"{num_tokens} tokens asked, {captured.num_tokens} captured")
        for g, (role, layers, table) in enumerate(zip(self.roles, self.layer_groups, block_tables)):
            for tensor, layer in zip(kv_caches[g], layers):
                if role.kind == SLIDING:
                    _rows_to_blocks(captured.sliding[layer], tensor, table, num_tokens)
                elif role.kind == ENTRIES:
                    _rows_to_blocks(captured.entries[layer], tensor, table, num_tokens // _rate(role))
                else:
                    _rows_to_blocks(captured.overlap[layer], tensor, table, num_tokens)

    # -- consumer ----------------------------------------------------------------------------------

    def build_cache(self, model, kv_caches, block_tables: BlockTables, hit_tokens: int):
        """A transformers cache for positions ``[0, hit_tokens)`` built from the blocks alone.

        Reads only what the model's cache holds at ``H``: the sliding layer's last ``W - 1``
        positions, entries ``[0, H / rate)``, and CSA's overlap from ``[H - rate, H)``. Nothing
        else in any block is read, so junk (NaN included) elsewhere cannot reach the logits.
        """
        transformers = require_transformers()
        granularity = self.layout.hit_granularity_tokens
        if not isinstance(hit_tokens, int) or hit_tokens < 1 or hit_tokens % granularity:
            raise ValueError(f"hit_tokens must be a positive multiple of {granularity} (every compression rate), got {hit_tokens!r}")
        cache = transformers.DynamicCache(config=model.config)
        window = self.spec.sliding_window
        index_of = {role: g for g, role in enumerate(self.roles)}
        sliding_group = index_of[GroupRole(SLIDING)]
        for layer, layer_cache in enumerate(cache.layers):
            position = self.layer_groups[sliding_group].index(layer)
            start = max(0, hit_tokens - (window - 1))
            keys = _blocks_to_rows(kv_caches[sliding_group][position], block_tables[sliding_group], start, hit_tokens)
            keys = keys.transpose(0, 1).unsqueeze(0)  # [1, heads, positions, dim]
            layer_cache.update(keys, keys)
            layer_cache.cumulative_length = hit_tokens
            rate = self.rate_of.get(layer)
            if rate is None:
                continue
            g = index_of[GroupRole(ENTRIES, rate)]
            count = hit_tokens // rate
            entries = _blocks_to_rows(kv_caches[g][self.layer_groups[g].index(layer)], block_tables[g], 0, count)
            splits = [("compressor", 0, self.head_dim)]
            if self.layer_types[layer] == CSA:
                splits.append(("indexer", self.head_dim, self.head_dim + self.index_head_dim))
            compressor = model.model.layers[layer].self_attn.compressor
            modules = {"compressor": compressor, "indexer": getattr(compressor, "indexer", None)}
            for name, lo, hi in splits:
                kv_dtype = modules[name].kv_proj.weight.dtype  # what the compressor computes in
                layer_cache.compressed_kv[name] = entries[:, lo:hi].to(kv_dtype).unsqueeze(0).contiguous()
                layer_cache.entry_count[name] = count
                layer_cache.buffer_kv[name] = layer_cache.buffer_gate[name] = None  # empty at H
            if self.layer_types[layer] != CSA:
                continue
            g = index_of[GroupRole(OVERLAP, rate)]
            state = _blocks_to_rows(kv_caches[g][self.layer_groups[g].index(layer)], block_tables[g], hit_tokens - rate, hit_tokens)
            offset = 0
            for name, dim in (("compressor", self.head_dim), ("indexer", self.index_head_dim)):
                kv_dtype = modules[name].kv_proj.weight.dtype
                gate_dtype = torch.promote_types(modules[name].gate_proj.weight.dtype, modules[name].position_bias.dtype)
                layer_cache.overlap_kv[name] = state[:, offset : offset + dim].to(kv_dtype).unsqueeze(0).contiguous()
                layer_cache.overlap_gate[name] = state[:, offset + dim : offset + 2 * dim].to(gate_dtype).unsqueeze(0).contiguous()
                offset += 2 * dim
        return cache
