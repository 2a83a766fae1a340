"""Model layouts for ``kvtier replay``: kvtier groups plus the true bytes of one block of each.

Primitives: ``ReplayLayout`` (a ``ModelLayout`` and per-group block bytes, ``scaled`` for
``--bytes-scale``), ``PRESETS`` / ``preset`` (built-in layouts named after real models),
``layout_from_model_config`` (a transformers ``config.json``), ``layout_from_vllm_file`` (the
``vllm-layout-*.json`` a vLLM server with ``KvtierTier`` leaves in its cache directory),
``resolve_layout`` (what the command line names). Pure; any thread.

Every preset is a function of ``R`` (MTP's extra retained tokens, on the sliding groups only), so
the sweep can vary ``R`` over one geometry. Block bytes count every layer of the group, K and V.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kvtier.policy import AttentionGroup, ModelLayout

__all__ = ["ReplayLayout", "PRESETS", "preset", "layout_from_model_config", "layout_from_vllm_file", "resolve_layout"]

_BF16 = 2
_FP32 = 4


@dataclass(frozen=True)
class ReplayLayout:
    """``layout`` with ``block_bytes[g]``: bytes of one device block of group ``g`` (all its layers).
    ``group_names`` label the report; ``scale`` is the ``--bytes-scale`` already applied and
    ``full_block_bytes`` the model's true block bytes (equal to ``block_bytes`` unscaled)."""

    name: str
    layout: ModelLayout
    block_bytes: Tuple[int, ...]
    group_names: Tuple[str, ...]
    scale: float = 1.0
    full_block_bytes: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.full_block_bytes:
            object.__setattr__(self, "full_block_bytes", tuple(self.block_bytes))

    def full_chunk_bytes(self, group_index: int) -> int:
        """The model's true bytes of one chunk of the group, whatever the scale."""
        return self.full_block_bytes[group_index] * self.layout.groups[group_index].blocks_per_chunk

    def chunk_bytes(self, group_index: int) -> int:
        return self.block_bytes[group_index] * self.layout.groups[group_index].blocks_per_chunk

    @property
    def all_chunk_bytes(self) -> List[int]:
        return [self.chunk_bytes(g) for g in range(len(self.layout.groups))]

    def bytes_per_token(self, group_index: int) -> float:
        return self.block_bytes[group_index] / self.layout.groups[group_index].block_size

    def scaled(self, scale: float, record_overhead: Sequence[int] = ()) -> "ReplayLayout":
        """Chunks whose stored records are ``scale`` times the true ones: a chunk's record is its
        payload plus a header of ``record_overhead`` bytes, so the payload becomes
        ``scale * (chunk + overhead) - overhead`` (rounded to whole blocks). Every record, hence
        every disk cost and budget, shrinks by the same factor, and a byte LRU makes the same
        choices at any scale (a payload merely times ``scale`` would make the fixed header a
        larger share of small chunks than of large ones)."""
        if not (isinstance(scale, (int, float)) and 0 < scale <= 1):
            raise ValueError(f"--bytes-scale must be in (0, 1], got {scale!r}")
        if scale == 1:
            return self
        blocks = []
        for g, group in enumerate(self.layout.groups):
            per_chunk = group.blocks_per_chunk
            overhead = record_overhead[g] if record_overhead else 0
            payload = scale * (self.block_bytes[g] * per_chunk + overhead) - overhead
            block = round(payload / per_chunk)
            if block < 1:
                raise ValueError(f"--bytes-scale {scale:g} is too small for {self.name}'s {self.group_names[g]} group: "
                                 f"its records ({self.block_bytes[g] * per_chunk + overhead} bytes) would shrink below "
                                 f"their own {overhead}-byte header")
            blocks.append(block)
        return replace(self, block_bytes=tuple(blocks), scale=self.scale * scale, full_block_bytes=self.full_block_bytes)

    def describe(self) -> str:
        parts = []
        for g, group in enumerate(self.layout.groups):
            kind = "full" if group.sliding_window is None else f"SWA W={group.sliding_window} R={group.extra_retained_tokens}"
            parts.append(f"{self.group_names[g]} ({kind}, {group.tokens_per_chunk}-token chunks, "
                         f"{self.chunk_bytes(g)} B/chunk)")
        return f"{self.name}: " + "; ".join(parts)


def _group(block: int, per_chunk: int, window: Optional[int] = None, extra: int = 0) -> AttentionGroup:
    return AttentionGroup(block, blocks_per_chunk=per_chunk, sliding_window=window,
                          extra_retained_tokens=extra if window is not None else 0)


def _full_attention(extra: int) -> ReplayLayout:
    # One full-attention group of 512-token chunks (32 blocks of 16), the trace's own blocks; bytes of
    # a Llama-3-8B-like model (32 layers, 8 KV heads, head dim 128, bf16): 128 KiB per token.
    per_token = 32 * 2 * 8 * 128 * _BF16
    return ReplayLayout("full-attention", ModelLayout((_group(16, 32),)), (per_token * 16,), ("full",))


def _gpt_oss(extra: int) -> ReplayLayout:
    # gpt-oss-120b: 36 layers alternating full and sliding (W=128), GQA 8 KV heads, head dim 64, bf16.
    # Full attention in 512-token chunks; the sliding group in 16-token chunks, so the store mask
    # keeps only the window's blocks at each 512-token boundary.
    per_token = 18 * 2 * 8 * 64 * _BF16
    layout = ModelLayout((_group(16, 32), _group(16, 1, 128, extra)))
    return ReplayLayout("gpt-oss-120b", layout, (per_token * 16, per_token * 16), ("full", "sliding"))


def _gemma3(extra: int) -> ReplayLayout:
    # Gemma-3-27B: 62 layers, one global layer in six (10 full, 52 sliding, W=1024), 16 KV heads,
    # head dim 128, bf16. Sliding chunks of 64 tokens.
    per_layer = 2 * 16 * 128 * _BF16
    layout = ModelLayout((_group(16, 32), _group(16, 4, 1024, extra)))
    return ReplayLayout("gemma-3-27b", layout, (10 * per_layer * 16, 52 * per_layer * 16), ("full", "sliding"))


def _deepseek_v4(extra: int) -> ReplayLayout:
    # DeepSeek-V4-Flash (transformers' DeepseekV4Config defaults): 43 layers, each with a sliding
    # window (W=128) of K=V (1 head, head dim 512, bf16); 20 CSA layers (rate 4) with compressor and
    # indexer entries (512 + 128 floats, fp32) and their window carry (2 * 512 + 2 * 128 floats per
    # token); 23 HCA layers (rate 128, 512 floats). Groups as policy/compressed.py lays them out:
    # sliding block 64, 4 blocks per chunk, so hits land every 512 tokens.
    from kvtier.policy.compressed import CompressedAttentionLayout

    spec = CompressedAttentionLayout(block_size=64, sliding_window=128, compress_rates=(4, 128), overlap_rates=(4,),
                                     blocks_per_chunk=4, extra_retained_tokens=extra)
    layout = spec.layout()
    sliding, csa, hca, overlap = layout.groups
    block_bytes = (
        43 * 512 * _BF16 * sliding.block_size,
        20 * (512 + 128) * _FP32 * (csa.block_size // 4),
        23 * 512 * _FP32 * (hca.block_size // 128),
        20 * (2 * 512 + 2 * 128) * _FP32 * overlap.block_size,
    )
    return ReplayLayout("deepseek-v4", layout, block_bytes, ("sliding", "csa-entries", "hca-entries", "csa-carry"))


PRESETS: Dict[str, Callable[[int], ReplayLayout]] = {
    "full-attention": _full_attention,
    "gpt-oss-120b": _gpt_oss,
    "gemma-3-27b": _gemma3,
    "deepseek-v4": _deepseek_v4,
}


def preset(name: str, extra_retained_tokens: int = 0) -> ReplayLayout:
    """The preset ``name`` with ``R = extra_retained_tokens``; an unknown name lists the valid ones."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(f"--layout {name!r} is not a preset; valid: {', '.join(sorted(PRESETS))}") from None
    return factory(extra_retained_tokens)


def _namespace(value):
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    return value


def _read_config(path: str):
    """A transformers config from ``config.json`` (or its directory): transformers' own class
    when installed (per-layer configs, defaults), else the JSON's fields as attributes."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, "r", encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise ValueError(f"--model-config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--model-config {file}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model-config {file}: expected a JSON object")
    try:
        import transformers

        return transformers.AutoConfig.for_model(**data)
    except Exception:  # no transformers, or a model type it does not know: the fields serve
        config = _namespace(data)
        text = getattr(config, "text_config", None)
        return text if text is not None else config


def _dtype_bytes(config) -> int:
    name = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "bfloat16")
    name = name.replace("torch.", "")
    sizes = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "fp8": 1}
    if name not in sizes:
        raise ValueError(f"--model-config: unsupported dtype {name!r}")
    return sizes[name]


def layout_from_model_config(path: str, *, extra_retained_tokens: int = 0, block_size: int = 16,
                             full_blocks_per_chunk: int = 32, sliding_blocks_per_chunk: int = 1) -> ReplayLayout:
    """The layout of a transformers ``config.json``: groups as ``warmup`` builds them
    (``integrations.transformers.layout_from_config``; DeepSeek-V4 through ``DeepseekV4CachePlan``), block
    bytes from each layer's KV heads and head dims in the config's dtype."""
    from kvtier.integrations.transformers import (
        DeepseekV4CachePlan,
        is_compressed_attention,
        layer_kv_shapes,
        layout_from_config,
        text_config,
    )

    config = _read_config(path)
    name = f"model-config:{getattr(text_config(config), 'model_type', None) or os.path.basename(path)}"
    if is_compressed_attention(config):
        import torch

        plan = DeepseekV4CachePlan(config, block_size=64, blocks_per_chunk=4, extra_retained_tokens=extra_retained_tokens)
        block_bytes = []
        for g, (layers, shape, dtype) in enumerate(zip(plan.layer_groups, plan.item_shapes(), plan.group_dtypes(torch.bfloat16))):
            item = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            block_bytes.append(len(layers) * plan.items_per_block(g) * item)
        roles = tuple(r.kind + (f"-{r.rate}" if r.rate else "") for r in plan.roles)
        return ReplayLayout(name, plan.layout, tuple(block_bytes), roles)
    layout, layer_groups = layout_from_config(config, block_size=block_size, blocks_per_chunk=1,
                                              extra_retained_tokens=extra_retained_tokens)
    shapes = layer_kv_shapes(config)
    width = _dtype_bytes(text_config(config))
    groups, block_bytes, names = [], [], []
    for group, layers in zip(layout.groups, layer_groups):
        per_chunk = full_blocks_per_chunk if group.sliding_window is None else sliding_blocks_per_chunk
        groups.append(replace(group, blocks_per_chunk=per_chunk))
        block_bytes.append(sum(shapes[i][0] * (shapes[i][1] + shapes[i][2]) for i in layers) * width * block_size)
        names.append(("full" if group.sliding_window is None else "sliding") + f"-{len(layers)}L")
    return ReplayLayout(name, ModelLayout(tuple(groups)), tuple(block_bytes), tuple(names))


def layout_from_vllm_file(path: str, *, extra_retained_tokens: int = 0, sliding_window: Optional[int] = None) -> ReplayLayout:
    """The layout a vLLM server with ``KvtierTier`` described in its ``vllm-layout-*.json``: one
    group per offloaded vLLM group, chunks of ``blocks_per_chunk`` blocks of ``primary_row_bytes``
    each (vLLM's CPU tier keeps one row per chunk, the same size in every group). The file records
    a sliding group's window only in chunks; ``sliding_window`` (tokens) overrides that bound."""
    from kvtier.integrations.vllm.keys import VllmLayout

    try:
        with open(path, "r", encoding="utf-8") as handle:
            vllm = VllmLayout.from_json(handle.read())
    except OSError as exc:
        raise ValueError(f"--vllm-layout {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--vllm-layout {path}: not a vLLM layout file ({exc!r})") from None
    groups, names = [], []
    for g in vllm.groups:
        chunk_tokens = g.tokens_per_block * vllm.blocks_per_chunk
        window = None
        if g.sliding_window_size_in_chunks is not None:
            window = sliding_window or int(g.sliding_window_size_in_chunks) * chunk_tokens
        groups.append(_group(g.tokens_per_block, vllm.blocks_per_chunk, window, extra_retained_tokens))
        names.append(f"vllm-group-{g.group_id}")
    block = max(1, vllm.primary_row_bytes // vllm.blocks_per_chunk)
    return ReplayLayout(f"vllm:{vllm.model}", ModelLayout(tuple(groups)), tuple(block for _ in groups), tuple(names))


def resolve_layout(name: Optional[str], *, model_config: Optional[str] = None, vllm_layout: Optional[str] = None,
                   extra_retained_tokens: int = 0) -> ReplayLayout:
    """What ``--layout`` / ``--model-config`` / ``--vllm-layout`` name (one of them; default the
    ``full-attention`` preset). ``--bytes-scale`` is ``workload.scaled_layout``'s: scaling needs
    the record sizes the workload measures."""
    given = [n for n, v in (("--layout", name), ("--model-config", model_config), ("--vllm-layout", vllm_layout)) if v]
    if len(given) > 1:
        raise ValueError(f"give one of --layout, --model-config, --vllm-layout, not {' and '.join(given)}")
    if model_config:
        layout = layout_from_model_config(model_config, extra_retained_tokens=extra_retained_tokens)
    elif vllm_layout:
        layout = layout_from_vllm_file(vllm_layout, extra_retained_tokens=extra_retained_tokens)
    else:
        layout = preset(name or "full-attention", extra_retained_tokens)
    return layout

