"""Positions <-> paged blocks: zeroed paged tensors for a layout, one prompt's K/V written into
blocks through block tables, read back, and a transformers cache built from the restored blocks
alone (sliding layers get only their retained interval, finite garbage before it). Call from the
model's thread.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import torch

from kvtier.policy import ModelLayout, cdiv, retained_interval

from ._common import BlockTables, LayerKV, new_full_cache, text_config, valid_block
from .config import group_block_shapes, layer_kv_shapes

__all__ = ["allocate_kv_blocks", "write_kv_to_blocks", "read_kv_from_blocks", "build_cache_from_blocks"]

# Masked attention weights are exactly 0, and 0 * finite = 0, so finite junk outside the window is
# harmless when the window is right and loud when it is not. NaN would poison even masked sums.
_GARBAGE_SCALE = 1e4


def allocate_kv_blocks(
    config: Any,
    layout: ModelLayout,
    layer_groups: Sequence[Sequence[int]],
    num_blocks: Union[int, Sequence[int]],
    dtype: torch.dtype,
    device: Union[str, torch.device] = "cpu",
) -> List[List[torch.Tensor]]:
    """Zeroed paged KV tensors: ``kv_caches[g][j]`` is layer ``layer_groups[g][j]``'s
    ``[num_blocks, *kv_block_shape]`` tensor: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
    (index 0 of dim 1 is K, 1 is V), or ``[num_blocks, block_size, num_kv_heads, k_dim + v_dim]``
    when K and V differ in size.

    ``num_blocks`` is one count for every group or one per group.
    """
    if len(layer_groups) != len(layout.groups):
        raise ValueError(f"layer_groups has {len(layer_groups)} groups, the layout {len(layout.groups)}")
    counts = [num_blocks] * len(layout.groups) if isinstance(num_blocks, int) else list(num_blocks)
    if len(counts) != len(layout.groups) or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"num_blocks must be a positive int or one per group, got {num_blocks!r}")
    shapes = group_block_shapes(config, layout, layer_groups)
    return [
        [torch.zeros(count, *shape, dtype=dtype, device=device) for _ in layers]
        for shape, layers, count in zip(shapes, layer_groups, counts)
    ]



def _check_group_args(kv_caches, layer_groups, block_tables) -> None:
    if not len(kv_caches) == len(layer_groups) == len(block_tables):
        raise ValueError(
            f"kv_caches ({len(kv_caches)}), layer_groups ({len(layer_groups)}) and block_tables "
            f"({len(block_tables)}) must have one entry per group"
        )
    for g, (tensors, layers) in enumerate(zip(kv_caches, layer_groups)):
        if len(tensors) != len(layers):
            raise ValueError(f"group {g}: {len(tensors)} layer tensors for {len(layers)} layers")


def _block_size_of(tensor: torch.Tensor) -> int:
    # [n, 2, b, heads, dim] (K and V stacked) or [n, b, heads, k + v] (K and V differ in size)
    return tensor.shape[2] if tensor.dim() == 5 else tensor.shape[1]


def _to_blocks(keys: torch.Tensor, values: torch.Tensor, tensor: torch.Tensor, num_tokens: int, num_blocks: int, layer: int):
    """Positions ``[0, num_tokens)`` of one layer's K/V as ``[num_blocks, *block_shape]`` of
    ``tensor``'s layout, the tail of a partial last block zero-filled."""
    heads, _, k_dim = keys.shape
    v_dim = values.shape[2]
    block_size = _block_size_of(tensor)
    padded = num_blocks * block_size
    if tensor.dim() == 5:
        if (tensor.shape[3], tensor.shape[4]) != (heads, k_dim) or v_dim != k_dim:
            raise ValueError(
                f"layer {layer}: K {heads}x{k_dim} / V {values.shape[0]}x{v_dim} (heads x dim) but the block "
                f"tensor holds {tensor.shape[3]}x{tensor.shape[4]} for both"
            )
        staged = torch.zeros(2, heads, padded, k_dim, dtype=tensor.dtype, device=tensor.device)
        staged[0, :, :num_tokens] = keys[:, :num_tokens]
        staged[1, :, :num_tokens] = values[:, :num_tokens]
        # [2, heads, blocks, b, dim] -> [blocks, 2, b, heads, dim]
        return staged.view(2, heads, num_blocks, block_size, k_dim).permute(2, 0, 3, 1, 4)
    if (tensor.shape[2], tensor.shape[3]) != (heads, k_dim + v_dim):
        raise ValueError(
            f"layer {layer}: K {heads}x{k_dim} and V x{v_dim} (heads x dim) but the block tensor holds "
            f"{tensor.shape[2]} heads x {tensor.shape[3]} (K + V) per token"
        )
    staged = torch.zeros(heads, padded, k_dim + v_dim, dtype=tensor.dtype, device=tensor.device)
    staged[:, :num_tokens, :k_dim] = keys[:, :num_tokens]
    staged[:, :num_tokens, k_dim:] = values[:, :num_tokens]
    # [heads, blocks, b, k + v] -> [blocks, b, heads, k + v]
    return staged.view(heads, num_blocks, block_size, k_dim + v_dim).permute(1, 2, 0, 3)


def write_kv_to_blocks(
    kv: Sequence[LayerKV],
    kv_caches: Sequence[Sequence[torch.Tensor]],
    layer_groups: Sequence[Sequence[int]],
    block_tables: BlockTables,
    num_tokens: int,
) -> None:
    """Copy positions ``[0, num_tokens)`` of ``kv`` (per model layer, as from ``capture_kv``) into
    the paged blocks: logical block ``i`` of group ``g`` goes to device block
    ``block_tables[g][i]``; blocks without a device block (``None`` / negative) are skipped. The tail
    of a partial last block is zero-filled. A K/V shape that does not fit the block tensor raises
    ``ValueError`` before anything is written to that layer."""
    _check_group_args(kv_caches, layer_groups, block_tables)
    for g, (tensors, layers, table) in enumerate(zip(kv_caches, layer_groups, block_tables)):
        block_size = _block_size_of(tensors[0])
        num_blocks = cdiv(num_tokens, block_size)
        if len(table) < num_blocks:
            raise ValueError(f"block_tables[{g}] has {len(table)} blocks, {num_tokens} tokens need {num_blocks}")
        logical: List[int] = []
        device_blocks: List[int] = []
        for i in range(num_blocks):
            block = table[i]
            if valid_block(block):
                logical.append(i)
                device_blocks.append(int(block))
        if not logical:
            continue
        device = tensors[0].device
        src_index = torch.tensor(logical, dtype=torch.long, device=device)
        dst_index = torch.tensor(device_blocks, dtype=torch.long, device=device)
        for tensor, layer in zip(tensors, layers):
            keys, values = kv[layer]
            if keys.shape[1] < num_tokens:
                raise ValueError(f"layer {layer}: {keys.shape[1]} positions captured, {num_tokens} needed")
            blocks = _to_blocks(keys, values, tensor, num_tokens, num_blocks, layer)
            tensor.index_copy_(0, dst_index, blocks.index_select(0, src_index).contiguous())


def read_kv_from_blocks(
    kv_caches: Sequence[Sequence[torch.Tensor]],
    layer_groups: Sequence[Sequence[int]],
    block_tables: BlockTables,
    num_tokens: int,
    *,
    missing: float = 0.0,
    k_head_dims: Optional[Sequence[Optional[int]]] = None,
) -> List[Optional[LayerKV]]:
    """The inverse of ``write_kv_to_blocks``: per model layer ``(K, V)``, each
    ``[num_kv_heads, num_tokens, dim]``, read from the paged blocks. Positions of blocks without a
    device block hold ``missing``. Layers in no group are ``None``. A group whose blocks hold K and
    V of different sizes (``[n, b, heads, k + v]``) needs its K size in ``k_head_dims[g]``."""
    _check_group_args(kv_caches, layer_groups, block_tables)
    num_layers = 1 + max((layer for layers in layer_groups for layer in layers), default=-1)
    result: List[Optional[LayerKV]] = [None] * num_layers
    for g, (tensors, layers, table) in enumerate(zip(kv_caches, layer_groups, block_tables)):
        block_size = _block_size_of(tensors[0])
        num_blocks = cdiv(num_tokens, block_size)
        if len(table) < num_blocks:
            raise ValueError(f"block_tables[{g}] has {len(table)} blocks, {num_tokens} tokens need {num_blocks}")
        split = None if tensors[0].dim() == 5 else (k_head_dims or [None] * len(tensors))[g]
        if tensors[0].dim() != 5 and split is None:
            raise ValueError(f"group {g} holds K and V of different sizes: k_head_dims[{g}] is needed")
        for tensor, layer in zip(tensors, layers):
            out = torch.full((num_blocks, *tensor.shape[1:]), missing, dtype=tensor.dtype, device=tensor.device)
            for i in range(num_blocks):
                block = table[i]
                if valid_block(block):
                    out[i] = tensor[int(block)]
            if tensor.dim() == 5:
                heads, head_dim = tensor.shape[3], tensor.shape[4]
                # [blocks, 2, b, heads, dim] -> [2, heads, positions, dim]
                flat = out.permute(1, 3, 0, 2, 4).reshape(2, heads, num_blocks * block_size, head_dim)
                keys, values = flat[0], flat[1]
            else:
                heads, width = tensor.shape[2], tensor.shape[3]
                # [blocks, b, heads, k + v] -> [heads, positions, k + v]
                flat = out.permute(2, 0, 1, 3).reshape(heads, num_blocks * block_size, width)
                keys, values = flat[..., :split], flat[..., split:]
            result[layer] = (keys[:, :num_tokens].contiguous(), values[:, :num_tokens].contiguous())
    return result


def build_cache_from_blocks(
    model_config: Any,
    kv_caches: Sequence[Sequence[torch.Tensor]],
    layer_groups: Sequence[Sequence[int]],
    block_tables: BlockTables,
    layout: ModelLayout,
    hit_tokens: int,
    fill: str = "garbage",
    *,
    generator: Optional[torch.Generator] = None,
):
    """A transformers ``DynamicCache`` holding positions ``[0, hit_tokens)`` of every layer, built
    from the paged blocks alone.

    Full-attention layers read ``[0, H)``. Sliding-window layers read only
    ``retained_interval(group, H)``; every older position is ``fill``: ``"garbage"`` (the default,
    ``1e4 * randn``: finite, so a correctly masked position contributes exactly 0 and a wrongly
    attended one changes the logits) or ``"zeros"``. Every block meeting the retained interval must
    have a device block, else ``ValueError``.
    """
    if fill not in ("garbage", "zeros"):
        raise ValueError(f"fill must be 'garbage' or 'zeros', got {fill!r} (NaN would poison masked sums)")
    if len(layout.groups) != len(layer_groups):
        raise ValueError(f"layer_groups has {len(layer_groups)} groups, the layout {len(layout.groups)}")
    if not isinstance(hit_tokens, int) or hit_tokens < 1:
        raise ValueError(f"hit_tokens must be a positive int, got {hit_tokens!r}")
    num_layers = text_config(model_config).num_hidden_layers
    shapes = layer_kv_shapes(model_config)
    k_head_dims = [shapes[layers[0]][1] if layers else None for layers in layer_groups]
    per_layer = read_kv_from_blocks(kv_caches, layer_groups, block_tables, hit_tokens, k_head_dims=k_head_dims)
    restored = [item for item in per_layer if item is not None]
    if len(per_layer) != num_layers or len(restored) != num_layers:
        raise ValueError(f"layer_groups must cover all {num_layers} model layers exactly once")
    for g, (group, table) in enumerate(zip(layout.groups, block_tables)):
        start, _ = retained_interval(group, hit_tokens)
        for block in range(start // group.block_size, cdiv(hit_tokens, group.block_size)):
            if not valid_block(table[block]):
                raise ValueError(
                    f"group {g}: logical block {block} meets the retained interval "
                    f"[{start}, {hit_tokens}) but has no device block"
                )
        if start == 0:
            continue
        for layer in layer_groups[g]:
            keys, values = restored[layer]
            for tensor in (keys, values):
                if fill == "zeros":
                    tensor[:, :start] = 0
                else:
                    noise = torch.randn(tensor[:, :start].shape, generator=generator, dtype=torch.float32)
                    tensor[:, :start] = (noise * _GARBAGE_SCALE).to(tensor.dtype).to(tensor.device)
    cache = new_full_cache()
    for layer, (keys, values) in enumerate(restored):
        cache.update(keys.unsqueeze(0), values.unsqueeze(0), layer)
    return cache
