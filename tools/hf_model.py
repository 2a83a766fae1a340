"""Hugging Face transformers integration: a causal LM's KV cache seen as kvtier's paged blocks.

Primitives (plain functions, no engine logic; call them from one thread at a time, the model's):

- ``cache_plan``: the model family's plan (``StandardCachePlan`` here, ``DeepseekV4CachePlan`` in
  ``hf_deepseek_v4``) with one set of verbs: ``layout``, ``allocate``, ``capture``, ``write``,
  ``build_cache``, ``fingerprint_shapes``. Config-level refusals (KV shared between layers, lossy
  or per-loop caches, chunked or bidirectional attention) raise ``ValueError`` here.
- ``layer_types_from_config`` / ``layout_from_config``: which layers are full attention and which are
  sliding window, and the ``ModelLayout`` (groups per attention type and K/V shape) with
  ``layer_groups[g]``, the model layer indices of group ``g``.
- ``layer_kv_shapes`` / ``allocate_kv_blocks``: per layer ``(kv_heads, k_dim, v_dim)`` and the
  paged tensors, per group a list of per-layer tensors ``[num_blocks, 2, block_size, heads, dim]``
  (K and V stacked), or ``[num_blocks, block_size, heads, k_dim + v_dim]`` when K and V differ.
  ``check_captured_shapes`` refuses a model whose cache differs from what its config says.
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
    "layer_kv_shapes",
    "kv_block_shape",
    "group_block_shapes",
    "check_captured_shapes",
    "StandardCachePlan",
    "cache_plan",
    "next_token_logits",
    "full_logits",
]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"  # Llama-4: kept as a sliding window of attention_chunk_size

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
    num_layers = _positive_int(config, "num_hidden_layers")
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
        chunk = _positive_int(config, "attention_chunk_size")
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
        window = chunk if chunk is not None else _positive_int(config, "sliding_window")
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
    num_layers = _positive_int(config, "num_hidden_layers")
    layer_types = list(getattr(config, "layer_types", None) or [FULL_ATTENTION] * num_layers)
    per_layer = getattr(config, "per_layer_config", None) if getattr(config, "is_heterogeneous", False) else None
    shapes = []
    for index in range(num_layers):
        layer = per_layer[index] if per_layer is not None else config
        num_heads = _positive_int(layer, "num_attention_heads")
        num_kv_heads = getattr(layer, "num_key_value_heads", None) or num_heads
        latent, rope = getattr(layer, "kv_lora_rank", None), getattr(layer, "qk_rope_head_dim", None)
        if isinstance(latent, int) and isinstance(rope, int):
            # MLA caches its latent (one "head"): the compressed KV as K and the shared RoPE key as V.
            num_kv_heads, k_dim, v_dim = 1, latent, rope
        else:
            k_dim = getattr(layer, "head_dim", None) or _positive_int(layer, "hidden_size") // num_heads
            v_dim = getattr(layer, "v_head_dim", None) or k_dim
        if layer_types[index] == SLIDING_ATTENTION:
            num_kv_heads *= _SLIDING_KV_HEAD_FACTOR.get(getattr(config, "model_type", None), 1)
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


def require_model_dir(model_dir: Any) -> str:
    """``model_dir`` as a path string when it is a directory; else a ``ValueError`` saying what it is
    (missing, or a file: kvtier never downloads models)."""
    path = os.fspath(model_dir)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"model directory {path!r} is not a directory (pass the directory holding config.json)")
    raise ValueError(f"model directory {path!r} does not exist (kvtier never downloads models)")


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
    path = require_model_dir(model_dir)
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


def check_captured_shapes(config: Any, kv: Sequence[LayerKV]) -> None:
    """``ValueError`` unless every layer of ``kv`` (from ``capture_kv``) has the K/V shapes
    ``layer_kv_shapes`` derived from ``config``: run it on a short probe before storing anything."""
    for layer, ((keys, values), (heads, k_dim, v_dim)) in enumerate(zip(kv, layer_kv_shapes(config))):
        got = (keys.shape[0], keys.shape[-1], values.shape[0], values.shape[-1])
        if got != (heads, k_dim, heads, v_dim):
            raise ValueError(
                f"unsupported model ({getattr(text_config(config), 'model_type', '?')}): layer {layer} caches K "
                f"{got[0]}x{got[1]} and V {got[2]}x{got[3]} (heads x dim), but its config gives "
                f"{heads}x{k_dim} and {heads}x{v_dim}; kvtier refuses rather than store a misread cache"
            )


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
        logical = [i for i in range(num_blocks) if _valid_block(table[i])]
        if not logical:
            continue
        device = tensors[0].device
        src_index = torch.tensor(logical, dtype=torch.long, device=device)
        dst_index = torch.tensor([int(table[i]) for i in logical], dtype=torch.long, device=device)
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
                if _valid_block(table[i]):
                    out[i] = tensor[int(table[i])]
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
    restored = read_kv_from_blocks(kv_caches, layer_groups, block_tables, hit_tokens, k_head_dims=k_head_dims)
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


# ------------------------------------------------------------------ one interface per cache family


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
    from .hf_deepseek_v4 import DeepseekV4CachePlan, is_compressed_attention

    geometry = dict(block_size=block_size, blocks_per_chunk=blocks_per_chunk, extra_retained_tokens=extra_retained_tokens)
    if is_compressed_attention(config):
        return DeepseekV4CachePlan(config, **geometry)
    return StandardCachePlan(config, **geometry)


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
