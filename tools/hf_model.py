"""Hugging Face transformers integration: a causal LM's KV cache seen as kvtier's paged blocks.

Primitives (plain functions, no engine logic; call them from one thread at a time, the model's):

- ``layer_types_from_config`` / ``layout_from_config``: which layers are full attention and which are
  sliding window, and the ``ModelLayout`` (one FA group, one SWA group) with ``layer_groups[g]``, the
  model layer indices of group ``g``.
- ``kv_head_shape`` / ``allocate_kv_blocks``: the serving-side paged KV tensors, per group a list of
  per-layer tensors ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (K and V stacked).
- ``load_model``: ``AutoModelForCausalLM.from_pretrained`` of a local directory, never a download.
- ``capture_kv``: every layer's K/V for every position of a prompt (post-norm, post-RoPE: what an
  attention kernel caches).
- ``write_kv_to_blocks`` / ``read_kv_from_blocks``: positions <-> paged blocks through block tables.
- ``build_cache_from_blocks``: a transformers cache built only from restored blocks: full-attention
  layers get ``[0, H)``, sliding-window layers only ``retained_interval`` and large finite garbage
  before it, so a window restored one token too short changes the logits instead of passing.
- ``next_token_logits`` / ``full_logits``: decode after a restored hit, and the full recompute.

K/V tensors exchanged with these functions have shape ``[num_kv_heads, seq, head_dim]`` (batch 1).
A block table entry that is ``None`` or negative means "no device block" (never restored); a
vLLM-style null block (a real block id whose bytes are junk) also works, since only the retained
interval is ever read.

transformers is imported lazily (the optional ``warmup`` extra), so importing this module needs
only torch.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kvtier.policy import AttentionGroup, ModelLayout, cdiv, retained_interval

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "text_config",
    "layer_types_from_config",
    "layout_from_config",
    "kv_head_shape",
    "allocate_kv_blocks",
    "parse_dtype",
    "load_model",
    "capture_kv",
    "write_kv_to_blocks",
    "read_kv_from_blocks",
    "build_cache_from_blocks",
    "next_token_logits",
    "full_logits",
]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

LayerKV = Tuple[torch.Tensor, torch.Tensor]
BlockTables = Sequence[Sequence[Optional[int]]]

# Masked attention weights are exactly 0, and 0 * finite = 0, so finite junk outside the window is
# harmless when the window is right and loud when it is not. NaN would poison even masked sums.
_GARBAGE_SCALE = 1e4
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvtier's Hugging Face integration needs transformers: "
            "python -m pip install 'kvtier[warmup]'"
        ) from exc
    return transformers


# ------------------------------------------------------------------ config -> layout


def text_config(config: Any) -> Any:
    """The decoder text config of ``config`` (a multimodal config wraps one), else ``config``."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:
            return get()
    return config


def _positive_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"unsupported model config ({getattr(config, 'model_type', type(config).__name__)}): "
            f"{name} must be a positive int, got {value!r}"
        )
    return value


def layer_types_from_config(config: Any) -> Tuple[List[str], Optional[int]]:
    """``(layer_types, sliding_window)``: per model layer ``"full_attention"`` or
    ``"sliding_attention"``, and the window ``W`` (``None`` when no layer slides).

    Gemma-3 / Qwen2 style configs list ``layer_types``; a Mistral-style config sets
    ``sliding_window`` for every layer; a plain Llama config has neither (all full attention).
    Anything kvtier cannot cache exactly (chunked or linear attention, bidirectional windows, layers
    sharing another layer's KV, KV-free layers) raises ``ValueError`` naming the problem.
    """
    config = text_config(config)
    model_type = getattr(config, "model_type", type(config).__name__)
    num_layers = _positive_int(config, "num_hidden_layers")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"unsupported model config ({model_type}): use_bidirectional_attention=True is not a "
            "causal KV cache"
        )
    for name in ("kv_sharing_modes", "num_kv_shared_layers"):
        if getattr(config, name, None):
            raise ValueError(
                f"unsupported model config ({model_type}): {name} is set (layers reuse another "
                "layer's KV); kvtier stores one K/V per layer"
            )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError(
            f"unsupported model config ({model_type}): chunked attention "
            f"(attention_chunk_size={config.attention_chunk_size!r}) has no sliding-window equivalent"
        )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        layer_types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * num_layers
    else:
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            raise ValueError(
                f"unsupported model config ({model_type}): {len(layer_types)} layer_types for "
                f"{num_layers} layers"
            )
        unknown = sorted({t for t in layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
        if unknown:
            raise ValueError(
                f"unsupported model config ({model_type}): layer types {unknown} (kvtier supports "
                f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r})"
            )
    if SLIDING_ATTENTION in layer_types:
        window = _positive_int(config, "sliding_window")
    else:
        window = None
    return layer_types, window


def layout_from_config(
    config: Any,
    *,
    block_size: int = 16,
    blocks_per_chunk: int = 1,
    extra_retained_tokens: int = 0,
) -> Tuple[ModelLayout, List[List[int]]]:
    """``(layout, layer_groups)`` of a transformers causal-LM config.

    Groups, in this order: one full-attention group if any layer is full attention, one
    sliding-window group (window from the config, ``extra_retained_tokens`` = ``R``) if any layer
    slides. ``layer_groups[g]`` lists the model layer indices of group ``g`` in layer order. Both
    groups use ``block_size`` and ``blocks_per_chunk``.
    """
    layer_types, window = layer_types_from_config(config)
    full = [i for i, t in enumerate(layer_types) if t == FULL_ATTENTION]
    sliding = [i for i, t in enumerate(layer_types) if t == SLIDING_ATTENTION]
    groups: List[AttentionGroup] = []
    layer_groups: List[List[int]] = []
    if full:
        groups.append(AttentionGroup(block_size=block_size, blocks_per_chunk=blocks_per_chunk))
        layer_groups.append(full)
    if sliding:
        groups.append(
            AttentionGroup(
                block_size=block_size,
                blocks_per_chunk=blocks_per_chunk,
                sliding_window=window,
                extra_retained_tokens=extra_retained_tokens,
            )
        )
        layer_groups.append(sliding)
    return ModelLayout(tuple(groups)), layer_groups


def kv_head_shape(config: Any) -> Tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of every layer of ``config``."""
    config = text_config(config)
    num_heads = _positive_int(config, "num_attention_heads")
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or _positive_int(config, "hidden_size") // num_heads
    return int(num_kv_heads), int(head_dim)


def allocate_kv_blocks(
    config: Any,
    layout: ModelLayout,
    layer_groups: Sequence[Sequence[int]],
    num_blocks: Union[int, Sequence[int]],
    dtype: torch.dtype,
    device: Union[str, torch.device] = "cpu",
) -> List[List[torch.Tensor]]:
    """Zeroed paged KV tensors: ``kv_caches[g][j]`` is layer ``layer_groups[g][j]``'s
    ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` tensor (index 0 of dim 1 is K, 1 is V).

    ``num_blocks`` is one count for every group or one per group.
    """
    if len(layer_groups) != len(layout.groups):
        raise ValueError(f"layer_groups has {len(layer_groups)} groups, the layout {len(layout.groups)}")
    counts = [num_blocks] * len(layout.groups) if isinstance(num_blocks, int) else list(num_blocks)
    if len(counts) != len(layout.groups) or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"num_blocks must be a positive int or one per group, got {num_blocks!r}")
    num_kv_heads, head_dim = kv_head_shape(config)
    return [
        [
            torch.zeros(count, 2, group.block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in layers
        ]
        for group, layers, count in zip(layout.groups, layer_groups, counts)
    ]


# ------------------------------------------------------------------ model


def parse_dtype(dtype: Union[str, torch.dtype]) -> Tuple[str, torch.dtype]:
    """``(canonical name, torch dtype)`` of ``"float32"``, ``"bf16"``, ``torch.float16``..."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
        return name, dtype
    value = _DTYPES.get(str(dtype).lower())
    if value is None:
        raise ValueError(f"dtype must be one of float32, float16, bfloat16, got {dtype!r}")
    return str(value).replace("torch.", ""), value


def load_model(
    model_dir: Union[str, os.PathLike],
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: Union[str, torch.dtype] = "float32",
    attn_implementation: Optional[str] = None,
):
    """``AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)`` in eval mode on
    ``device``. Never downloads: a missing or incomplete directory raises ``ValueError``."""
    transformers = _require_transformers()
    path = os.fspath(model_dir)
    if not os.path.isdir(path):
        raise ValueError(f"model directory {path!r} does not exist (kvtier never downloads models)")
    _, torch_dtype = parse_dtype(dtype)
    kwargs = {"local_files_only": True, "dtype": torch_dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    model.to(device)
    model.eval()
    return model


def tiny_hybrid_config(**overrides: Any) -> Any:
    """A small random-initialisable Gemma3 text config: three sliding-window layers (window 32) and
    one full-attention layer. Tests and the benchmark build models from it; nothing is downloaded."""
    transformers = _require_transformers()
    fields: Dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=32,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    fields.update(overrides)
    return transformers.Gemma3TextConfig(**fields)


def _cache_kwarg(model) -> str:
    # transformers 5 renamed `past_key_values` to `cache`; older releases only know the old name.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_full_cache():
    # A DynamicCache built without the config keeps every position of every layer: with the config
    # it would give sliding layers a DynamicSlidingWindowLayer that drops positions older than W.
    # Masks still follow each layer's type (the model builds them from its own config).
    transformers = _require_transformers()
    return transformers.DynamicCache()


def _token_tensor(token_ids: Sequence[int], device) -> torch.Tensor:
    return torch.as_tensor(list(token_ids), dtype=torch.long, device=device).unsqueeze(0)


@torch.no_grad()
def capture_kv(model, token_ids: Sequence[int]) -> List[LayerKV]:
    """Run the model over ``token_ids``; per model layer ``(K, V)``, each
    ``[num_kv_heads, len(token_ids), head_dim]``, for every position (sliding layers included)."""
    if len(token_ids) == 0:
        raise ValueError("token_ids must not be empty")
    device = next(model.parameters()).device
    cache = _new_full_cache()
    model(input_ids=_token_tensor(token_ids, device), use_cache=True, **{_cache_kwarg(model): cache})
    num_layers = text_config(model.config).num_hidden_layers
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:  # transformers 4.x keeps parallel lists
        pairs = list(zip(cache.key_cache, cache.value_cache))
    if len(pairs) != num_layers:
        raise ValueError(f"the model filled {len(pairs)} cache layers, expected {num_layers}")
    kv: List[LayerKV] = []
    for index, (keys, values) in enumerate(pairs):
        if keys is None or keys.shape[-2] != len(token_ids):
            raise ValueError(
                f"layer {index} cached {None if keys is None else keys.shape[-2]} positions, expected "
                f"{len(token_ids)}"
            )
        kv.append((keys[0], values[0]))
    return kv


# ------------------------------------------------------------------ positions <-> blocks


def _valid_block(block: Optional[int]) -> bool:
    return block is not None and int(block) >= 0


def _check_group_args(kv_caches, layer_groups, block_tables) -> None:
    if not len(kv_caches) == len(layer_groups) == len(block_tables):
        raise ValueError(
            f"kv_caches ({len(kv_caches)}), layer_groups ({len(layer_groups)}) and block_tables "
            f"({len(block_tables)}) must have one entry per group"
        )
    for g, (tensors, layers) in enumerate(zip(kv_caches, layer_groups)):
        if len(tensors) != len(layers):
            raise ValueError(f"group {g}: {len(tensors)} layer tensors for {len(layers)} layers")


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
    of a partial last block is zero-filled."""
    _check_group_args(kv_caches, layer_groups, block_tables)
    for g, (tensors, layers, table) in enumerate(zip(kv_caches, layer_groups, block_tables)):
        block_size = tensors[0].shape[2]
        num_blocks = cdiv(num_tokens, block_size)
        if len(table) < num_blocks:
            raise ValueError(f"block_tables[{g}] has {len(table)} blocks, {num_tokens} tokens need {num_blocks}")
        logical = [i for i in range(num_blocks) if _valid_block(table[i])]
        if not logical:
            continue
        device = tensors[0].device
        src_index = torch.tensor(logical, dtype=torch.long, device=device)
        dst_index = torch.tensor([int(table[i]) for i in logical], dtype=torch.long, device=device)
        padded = num_blocks * block_size
        for tensor, layer in zip(tensors, layers):
            keys, values = kv[layer]
            if keys.shape[1] < num_tokens:
                raise ValueError(f"layer {layer}: {keys.shape[1]} positions captured, {num_tokens} needed")
            heads, _, head_dim = keys.shape
            if (tensor.shape[3], tensor.shape[4]) != (heads, head_dim):
                raise ValueError(
                    f"layer {layer}: K/V heads x dim {heads}x{head_dim} but the block tensor holds "
                    f"{tensor.shape[3]}x{tensor.shape[4]}"
                )
            staged = torch.zeros(2, heads, padded, head_dim, dtype=tensor.dtype, device=device)
            staged[0, :, :num_tokens] = keys[:, :num_tokens]
            staged[1, :, :num_tokens] = values[:, :num_tokens]
            # [2, heads, blocks, b, dim] -> [blocks, 2, b, heads, dim]
            blocks = staged.view(2, heads, num_blocks, block_size, head_dim).permute(2, 0, 3, 1, 4)
            tensor.index_copy_(0, dst_index, blocks.index_select(0, src_index).contiguous())


def read_kv_from_blocks(
    kv_caches: Sequence[Sequence[torch.Tensor]],
    layer_groups: Sequence[Sequence[int]],
    block_tables: BlockTables,
    num_tokens: int,
    *,
    missing: float = 0.0,
) -> List[Optional[LayerKV]]:
    """The inverse of ``write_kv_to_blocks``: per model layer ``(K, V)``, each
    ``[num_kv_heads, num_tokens, head_dim]``, read from the paged blocks. Positions of blocks
    without a device block hold ``missing``. Layers in no group are ``None``."""
    _check_group_args(kv_caches, layer_groups, block_tables)
    num_layers = 1 + max((layer for layers in layer_groups for layer in layers), default=-1)
    result: List[Optional[LayerKV]] = [None] * num_layers
    for g, (tensors, layers, table) in enumerate(zip(kv_caches, layer_groups, block_tables)):
        block_size = tensors[0].shape[2]
        num_blocks = cdiv(num_tokens, block_size)
        if len(table) < num_blocks:
            raise ValueError(f"block_tables[{g}] has {len(table)} blocks, {num_tokens} tokens need {num_blocks}")
        for tensor, layer in zip(tensors, layers):
            _, _, _, heads, head_dim = tensor.shape
            out = torch.full(
                (2, num_blocks, block_size, heads, head_dim), missing, dtype=tensor.dtype, device=tensor.device
            )
            for i in range(num_blocks):
                if _valid_block(table[i]):
                    out[:, i] = tensor[int(table[i])]
            # [2, blocks, b, heads, dim] -> [2, heads, positions, dim]
            flat = out.permute(0, 3, 1, 2, 4).reshape(2, heads, num_blocks * block_size, head_dim)
            result[layer] = (flat[0, :, :num_tokens].contiguous(), flat[1, :, :num_tokens].contiguous())
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
    restored = read_kv_from_blocks(kv_caches, layer_groups, block_tables, hit_tokens)
    if len(restored) != num_layers or any(item is None for item in restored):
        raise ValueError(f"layer_groups must cover all {num_layers} model layers exactly once")
    for g, (group, table) in enumerate(zip(layout.groups, block_tables)):
        start, _ = retained_interval(group, hit_tokens)
        for block in range(start // group.block_size, cdiv(hit_tokens, group.block_size)):
            if not _valid_block(table[block]):
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
    cache = _new_full_cache()
    for layer, (keys, values) in enumerate(restored):
        cache.update(keys.unsqueeze(0), values.unsqueeze(0), layer)
    return cache


# ------------------------------------------------------------------ decoding


@torch.no_grad()
def next_token_logits(model, cache, token_ids: Sequence[int], hit_tokens: int) -> torch.Tensor:
    """Run ``token_ids[hit_tokens:]`` on top of ``cache`` (positions ``[0, hit_tokens)``); the
    logits of the last position, ``[vocab]``, float32."""
    if not 0 < hit_tokens < len(token_ids):
        raise ValueError(f"hit_tokens must be in (0, {len(token_ids)}), got {hit_tokens!r}")
    device = next(model.parameters()).device
    input_ids = _token_tensor(token_ids[hit_tokens:], device)
    positions = torch.arange(hit_tokens, len(token_ids), device=device).unsqueeze(0)
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, **{_cache_kwarg(model): cache})
    return out.logits[0, -1].float()


@torch.no_grad()
def full_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """The last position's logits of a full recompute of ``token_ids`` (no cache), float32."""
    device = next(model.parameters()).device
    out = model(input_ids=_token_tensor(token_ids, device), use_cache=False)
    return out.logits[0, -1].float()
