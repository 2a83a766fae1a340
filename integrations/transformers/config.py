"""A transformers config read as kvtier's layout: which layers are full attention and which slide,
each layer's K/V shape, the groups (``ModelLayout`` plus the model layers of each group) and the
per-block tensor shapes; configs kvtier cannot cache exactly (KV shared between layers, lossy or
per-loop caches, bidirectional attention) raise ``ValueError`` naming the reason. Pure functions
of the config.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvtier.policy import AttentionGroup, ModelLayout

from ._common import CHUNKED_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, positive_int, text_config

__all__ = [
    "layer_types_from_config",
    "layer_kv_shapes",
    "layout_from_config",
    "kv_head_shape",
    "kv_block_shape",
    "group_block_shapes",
]


# Configuration values under which a model's own cached prefill does not reproduce a recompute, so
# no cache (kvtier's or the model's) can be exact: (field, value, why).
_LOSSY_CACHE_MODES = (
    (
        "recurrent_kv_cache_mode",
        "last_loop",
        "one KV per recurrent layer is written by the last loop only, so earlier loops read KV a "
        "recompute never sees; the model's own prefill-then-decode already differs from a recompute",
    ),
)


def _refuse_shared_kv(config: Any, model_type: str) -> None:
    """Refuse configs where a layer reads another layer's KV (kvtier stores one K/V per layer).

    Gemma-3n/4 list ``kv_sharing_modes``: ``None`` (own KV), ``"store"`` (own KV, also handed to an
    assistant model) or ``"reuse"`` (reads another layer's KV). Only ``"reuse"`` is refused, so
    ``num_kv_shared_layers=0`` (modes like ``[None, None, 'store', 'store']``) is accepted.
    """
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    try:
        modes = list(getattr(config, "kv_sharing_modes", None) or [])
    except ValueError as exc:  # Gemma-4 raises for an inconsistent sharing pattern
        raise ValueError(f"unsupported model config ({model_type}): {exc}") from None
    reusing = [index for index, mode in enumerate(modes) if mode not in (None, "store")]
    if shared or reusing:
        raise ValueError(
            f"unsupported model config ({model_type}): layers {reusing or 'at the end'} reuse another "
            f"layer's KV (num_kv_shared_layers={shared}); kvtier stores one K/V per layer"
        )


def _refuse_lossy_cache(config: Any, model_type: str) -> None:
    for field, value, why in _LOSSY_CACHE_MODES:
        if getattr(config, field, None) == value:
            raise ValueError(f"unsupported model config ({model_type}): {field}={value!r} is lossy: {why}")
    loops = getattr(config, "n_recurrent_loops", None)
    if isinstance(loops, int) and loops > 1:
        raise ValueError(
            f"unsupported model config ({model_type}): n_recurrent_loops={loops} keeps one KV per loop of "
            "the recurrent layers (more cache layers than model layers); kvtier maps one K/V per layer"
        )


def layer_types_from_config(config: Any) -> Tuple[List[str], Optional[int]]:
    """``(layer_types, sliding_window)``: per model layer ``"full_attention"`` or
    ``"sliding_attention"``, and the window ``W`` (``None`` when no layer slides).

    Gemma-3 / Qwen2 style configs list ``layer_types``; a Mistral-style config sets
    ``sliding_window`` for every layer; a plain Llama config has neither (all full attention).
    Llama-4's chunked layers are sliding layers of window ``attention_chunk_size`` (all a chunked
    layer reads lies in it). Anything kvtier cannot cache exactly (linear attention, bidirectional
    attention, layers sharing another layer's KV, KV-free layers) raises ``ValueError`` naming the
    problem.
    """
    config = text_config(config)
    model_type = getattr(config, "model_type", type(config).__name__)
    num_layers = positive_int(config, "num_hidden_layers")
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    # Gemma-4's "vision" makes only an image's own tokens see each other: text stays causal, and its
    # logits are those of None bit for bit. True (Gemma-3 embedders) and "all" make every token see
    # the ones after it: no prefix KV stays valid.
    if bidirectional not in (None, False, "vision"):
        raise ValueError(
            f"unsupported model config ({model_type}): use_bidirectional_attention={bidirectional!r} is not a "
            "causal KV cache (every token attends to later ones)"
        )
    _refuse_shared_kv(config, model_type)
    _refuse_lossy_cache(config, model_type)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None:
        # Chunked attention (Llama-4) at position p reads [p - p % C, p]: always inside the last C
        # positions, so a sliding window of C keeps all it reads (transformers caches these layers
        # as exactly that window). A config with its own, different sliding window is refused.
        chunk = positive_int(config, "attention_chunk_size")
        if window is not None and window != chunk:
            raise ValueError(
                f"unsupported model config ({model_type}): attention_chunk_size={chunk} and sliding_window={window} "
                "(kvtier keeps one window per model)"
            )
        if layer_types is None:
            layer_types = [CHUNKED_ATTENTION] * num_layers
        layer_types = [SLIDING_ATTENTION if t == CHUNKED_ATTENTION else t for t in layer_types]
        window = chunk
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
                f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r}, and DeepSeek-V4's compressed attention)"
            )
    if SLIDING_ATTENTION in layer_types:
        window = chunk if chunk is not None else positive_int(config, "sliding_window")
    else:
        window = None
    return layer_types, window


# Architectures whose sliding layers have more KV heads than the config's num_key_value_heads, in
# their modeling code rather than in the config (MiMo-V2-Flash: `num_key_value_heads * 2 if is_swa`).
_SLIDING_KV_HEAD_FACTOR = {"mimo_v2_flash": 2}


def layer_kv_shapes(config: Any) -> List[Tuple[int, int, int]]:
    """Per model layer ``(num_kv_heads, k_head_dim, v_head_dim)``, read from the config.

    Per-layer configs (transformers' heterogeneous configs: Gemma-4's full-attention layers have a
    larger ``head_dim`` and their own KV head count) are read layer by layer. The V size is
    ``v_head_dim`` where the config has one (MiMo-V2-Flash); an MLA config (``kv_lora_rank``) caches
    one latent "head": K is the compressed KV (``kv_lora_rank``), V the shared RoPE key. ``check_captured_shapes`` compares these with what the
    model really caches, so a config this function misreads is refused before anything is stored.
    """
    config = text_config(config)
    num_layers = positive_int(config, "num_hidden_layers")
    layer_types = list(getattr(config, "layer_types", None) or [FULL_ATTENTION] * num_layers)
    per_layer = getattr(config, "per_layer_config", None) if getattr(config, "is_heterogeneous", False) else None
    model_type = getattr(config, "model_type", None)
    sliding_factor = _SLIDING_KV_HEAD_FACTOR.get(model_type, 1) if isinstance(model_type, str) else 1
    shapes = []
    for index in range(num_layers):
        layer = per_layer[index] if per_layer is not None else config
        num_heads = positive_int(layer, "num_attention_heads")
        num_kv_heads = getattr(layer, "num_key_value_heads", None) or num_heads
        latent, rope = getattr(layer, "kv_lora_rank", None), getattr(layer, "qk_rope_head_dim", None)
        if isinstance(latent, int) and isinstance(rope, int):
            # MLA caches its latent (one "head"): the compressed KV as K and the shared RoPE key as V.
            num_kv_heads, k_dim, v_dim = 1, latent, rope
        else:
            k_dim = getattr(layer, "head_dim", None) or positive_int(layer, "hidden_size") // num_heads
            v_dim = getattr(layer, "v_head_dim", None) or k_dim
        if layer_types[index] == SLIDING_ATTENTION:
            num_kv_heads *= sliding_factor
        shapes.append((int(num_kv_heads), int(k_dim), int(v_dim)))
    return shapes


def layout_from_config(
    config: Any,
    *,
    block_size: int = 16,
    blocks_per_chunk: int = 1,
    extra_retained_tokens: int = 0,
) -> Tuple[ModelLayout, List[List[int]]]:
    """``(layout, layer_groups)`` of a transformers causal-LM config.

    Groups, in this order: full-attention groups, then sliding-window groups (window from the
    config, ``extra_retained_tokens`` = ``R``); layers of one attention type whose K/V shapes differ
    (``layer_kv_shapes``) go to separate groups, since a group's layers share one block shape.
    ``layer_groups[g]`` lists the model layer indices of group ``g`` in layer order. Every group
    uses ``block_size`` and ``blocks_per_chunk``.
    """
    layer_types, window = layer_types_from_config(config)
    shapes = layer_kv_shapes(config)
    groups: List[AttentionGroup] = []
    layer_groups: List[List[int]] = []
    for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
        by_shape: Dict[Tuple[int, int, int], List[int]] = {}
        for index, layer_type in enumerate(layer_types):
            if layer_type == kind:
                by_shape.setdefault(shapes[index], []).append(index)
        for layers in by_shape.values():
            groups.append(
                AttentionGroup(
                    block_size=block_size,
                    blocks_per_chunk=blocks_per_chunk,
                    sliding_window=window if kind == SLIDING_ATTENTION else None,
                    extra_retained_tokens=extra_retained_tokens if kind == SLIDING_ATTENTION else 0,
                )
            )
            layer_groups.append(layers)
    return ModelLayout(tuple(groups)), layer_groups


def kv_head_shape(config: Any) -> Tuple[int, int]:
    """``(num_kv_heads, head_dim)`` shared by every layer of ``config``.

    Raises ``ValueError`` when layers differ (use ``layer_kv_shapes``) or K and V differ in size.
    """
    shapes = set(layer_kv_shapes(config))
    if len(shapes) != 1 or len({(h, k) for h, k, v in shapes if k == v}) != 1:
        raise ValueError(
            f"K/V shapes (kv_heads, k_dim, v_dim) differ per layer or between K and V: {sorted(shapes)}; "
            "use layer_kv_shapes / group_block_shapes"
        )
    heads, k_dim, _ = shapes.pop()
    return heads, k_dim


def kv_block_shape(block_size: int, shape: Tuple[int, int, int]) -> Tuple[int, ...]:
    """One layer's per-block shape for ``(kv_heads, k_dim, v_dim)``: ``(2, b, heads, dim)`` (K and V
    stacked) when K and V have one size, else ``(b, heads, k_dim + v_dim)`` (K then V per head)."""
    heads, k_dim, v_dim = shape
    if k_dim == v_dim:
        return (2, block_size, heads, k_dim)
    return (block_size, heads, k_dim + v_dim)


def group_block_shapes(config: Any, layout: ModelLayout, layer_groups: Sequence[Sequence[int]]) -> List[Tuple[int, ...]]:
    """Per group, one layer's per-block shape (``kv_block_shape`` of the group's K/V shape)."""
    if len(layer_groups) != len(layout.groups):
        raise ValueError(f"layer_groups has {len(layer_groups)} groups, the layout {len(layout.groups)}")
    shapes = layer_kv_shapes(config)
    result = []
    for g, (group, layers) in enumerate(zip(layout.groups, layer_groups)):
        distinct = {shapes[layer] for layer in layers}
        if len(distinct) != 1:
            raise ValueError(f"group {g}: its layers have different K/V shapes {sorted(distinct)}")
        result.append(kv_block_shape(group.block_size, distinct.pop()))
    return result
