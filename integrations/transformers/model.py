"""The model itself: load a local directory (never a download), the tiny config tests and the bench
build models from, every layer's K/V of a prompt, the check that it matches what the config says,
and decoding on top of a restored cache against the full recompute. Call from the model's thread.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ._common import LayerKV, cache_kwarg, new_full_cache, require_transformers, text_config, token_tensor
from .config import layer_kv_shapes

__all__ = [
    "parse_dtype",
    "require_model_dir",
    "load_model",
    "tiny_hybrid_config",
    "capture_kv",
    "check_captured_shapes",
    "next_token_logits",
    "full_logits",
]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


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
    transformers = require_transformers()
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
    transformers = require_transformers()
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



@torch.no_grad()
def capture_kv(model, token_ids: Sequence[int]) -> List[LayerKV]:
    """Run the model over ``token_ids``; per model layer ``(K, V)``, each
    ``[num_kv_heads, len(token_ids), head_dim]``, for every position (sliding layers included)."""
    if len(token_ids) == 0:
        raise ValueError("token_ids must not be empty")
    device = next(model.parameters()).device
    cache = new_full_cache()
    model(input_ids=token_tensor(token_ids, device), use_cache=True, **{cache_kwarg(model): cache})
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



@torch.no_grad()
def next_token_logits(model, cache, token_ids: Sequence[int], hit_tokens: int) -> torch.Tensor:
    """Run ``token_ids[hit_tokens:]`` on top of ``cache`` (positions ``[0, hit_tokens)``); the
    logits of the last position, ``[vocab]``, float32."""
    if not 0 < hit_tokens < len(token_ids):
        raise ValueError(f"hit_tokens must be in (0, {len(token_ids)}), got {hit_tokens!r}")
    device = next(model.parameters()).device
    input_ids = token_tensor(token_ids[hit_tokens:], device)
    positions = torch.arange(hit_tokens, len(token_ids), device=device).unsqueeze(0)
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0, -1].float()


@torch.no_grad()
def full_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """The last position's logits of a full recompute of ``token_ids`` (no cache), float32."""
    device = next(model.parameters()).device
    out = model(input_ids=token_tensor(token_ids, device), use_cache=False)
    return out.logits[0, -1].float()
