"""kvtier.integrations.transformers: a Hugging Face causal LM's KV cache seen as kvtier's paged blocks.

Primitives (plain functions, no engine logic; call them from one thread at a time, the model's):

- ``cache_plan``: the model family's plan (``StandardCachePlan`` in ``plans``, ``DeepseekV4CachePlan`` in
  ``deepseek_v4``) with one set of verbs: ``layout``, ``allocate``, ``capture``, ``write``,
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

Modules: ``_common`` (what the others share), ``config`` (config -> layout and shapes), ``blocks``
(positions <-> paged blocks, the cache built from them), ``model`` (load, capture, decode),
``deepseek_v4`` (compressed attention), ``plans`` (one interface per cache family). transformers is
imported lazily (the optional ``warmup`` extra), so importing this package needs only torch.
"""

from ._common import FULL_ATTENTION, SLIDING_ATTENTION, BlockTables, LayerKV, require_transformers, text_config
from .blocks import allocate_kv_blocks, build_cache_from_blocks, read_kv_from_blocks, write_kv_to_blocks
from .config import (
    group_block_shapes,
    kv_block_shape,
    kv_head_shape,
    layer_kv_shapes,
    layer_types_from_config,
    layout_from_config,
)
from .deepseek_v4 import DeepseekV4CachePlan, DeepseekV4Capture, is_compressed_attention
from .model import (
    capture_kv,
    check_captured_shapes,
    full_logits,
    load_model,
    next_token_logits,
    parse_dtype,
    require_model_dir,
    tiny_hybrid_config,
)
from .plans import StandardCachePlan, cache_plan

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
    "require_model_dir",
    "require_transformers",
    "tiny_hybrid_config",
    "LayerKV",
    "BlockTables",
    "is_compressed_attention",
    "DeepseekV4CachePlan",
    "DeepseekV4Capture",
]
