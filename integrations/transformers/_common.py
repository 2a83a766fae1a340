"""What the transformers integration's modules share: the attention-type names, the K/V and block
table types, reading a (possibly multimodal) config, the lazy transformers import, token tensors and
the cache argument's name. Plain functions; call them from the model's thread.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence, Tuple, TypeGuard

import torch

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "CHUNKED_ATTENTION",
    "LayerKV",
    "BlockTables",
    "require_transformers",
    "text_config",
    "positive_int",
    "cache_kwarg",
    "new_full_cache",
    "token_tensor",
    "valid_block",
]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"  # Llama-4: kept as a sliding window of attention_chunk_size

LayerKV = Tuple[torch.Tensor, torch.Tensor]
BlockTables = Sequence[Sequence[Optional[int]]]



def require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvtier's Hugging Face integration needs transformers: "
            "python -m pip install 'kvtier[warmup]'"
        ) from exc
    return transformers



def text_config(config: Any) -> Any:
    """The decoder text config of ``config`` (a multimodal config wraps one), else ``config``."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:
            return get()
    return config


def positive_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"unsupported model config ({getattr(config, 'model_type', type(config).__name__)}): "
            f"{name} must be a positive int, got {value!r}"
        )
    return value



def cache_kwarg(model) -> str:
    # transformers 5 renamed `past_key_values` to `cache`; older releases only know the old name.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_full_cache():
    # A DynamicCache built without the config keeps every position of every layer: with the config
    # it would give sliding layers a DynamicSlidingWindowLayer that drops positions older than W.
    # Masks still follow each layer's type (the model builds them from its own config).
    transformers = require_transformers()
    return transformers.DynamicCache()


def token_tensor(token_ids: Sequence[int], device) -> torch.Tensor:
    return torch.as_tensor(list(token_ids), dtype=torch.long, device=device).unsqueeze(0)



def valid_block(block: Optional[int]) -> TypeGuard[int]:
    """Whether ``block`` names a device block: not ``None`` and not negative."""
    return block is not None and int(block) >= 0
