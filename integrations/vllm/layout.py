"""From vLLM's objects to kvtier's ``VllmLayout``: the layout of an ``OffloadingSpec`` and the key
scheme vLLM hashes with.

Primitives: ``layout_from_spec`` (the ``VllmLayout`` of a spec, its key scheme not bound yet),
``vllm_key_scheme`` (vLLM's hash algorithm and ``NONE_HASH``, read from vLLM's own state; ``None``
before vLLM seeded it) and ``parallel_sharing_note`` (the warning a tier logs when its records are
bound to one parallel layout). Pure functions, any thread; only ``vllm_key_scheme`` imports vLLM,
when called.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .config import HASH_ALGORITHMS, VllmTierConfig, VllmTierConfigError
from .keys import GroupLayout, VllmLayout

__all__ = ["layout_from_spec", "vllm_key_scheme", "parallel_sharing_note"]


def vllm_key_scheme(explicit: Optional[str]) -> Optional[Tuple[str, bytes]]:
    """(hash algorithm, NONE_HASH) of the block hashes vLLM computes now, or None before vLLM
    seeded NONE_HASH. vLLM builds its secondary tiers before ``init_none_hash`` and the offloading
    config does not name the algorithm, so both are read from vLLM's own state when it is set: the
    algorithm is the one whose hash of vLLM's seed is NONE_HASH (``explicit`` must be it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        return None
    none_hash = bytes(none_hash)
    seed = kv_cache_utils.get_none_hash_seed()
    for name in HASH_ALGORITHMS:
        if bytes(get_hash_fn_by_name(name)(seed)) == none_hash:
            if explicit is not None and explicit != name:
                raise VllmTierConfigError(
                    f"KvtierTier hash_algorithm is {explicit!r} but vLLM hashes prefix blocks with {name!r}")
            return name, none_hash
    if explicit is None:
        raise VllmTierConfigError(
            "KvtierTier cannot tell vLLM's prefix-caching hash algorithm from its NONE_HASH; "
            f"set hash_algorithm (one of {', '.join(HASH_ALGORITHMS)})")
    return explicit, none_hash


def layout_from_spec(spec: Any, primary_row_bytes: int, config: VllmTierConfig) -> VllmLayout:
    """The ``VllmLayout`` of a vLLM ``OffloadingSpec`` (its normalized ``OffloadingConfig``), its
    key scheme not bound yet. Where vLLM says the persisted block bytes are the same under any
    topology (``is_parallelism_agnostic``), the parallel sizes stay out of it and the bytes per
    block are counted across all workers, so servers of different TP sizes share records."""
    c = spec.config
    p = c.parallel
    if p.is_parallelism_agnostic:
        parallel: Dict[str, Any] = dict(parallelism_agnostic=True)
        kv_bytes_per_block = int(c.worker_kv_bytes_per_block) * int(p.world_size)
    else:
        parallel = dict(world_size=p.world_size, tp_size=p.tp_size, pp_size=p.pp_size, pcp_size=p.pcp_size,
                        dcp_size=p.dcp_size, parallelism_agnostic=False)
        kv_bytes_per_block = int(c.worker_kv_bytes_per_block)
    return VllmLayout(
        model=str(c.model.name),
        dtype=str(c.model.dtype),
        groups=tuple(
            GroupLayout(
                group_id=int(g.group_id),
                tokens_per_block=int(g.tokens_per_block),
                layer_names=tuple(g.layer_names),
                sliding_window_size_in_chunks=g.sliding_window_size_in_chunks,
            )
            for g in c.groups
        ),
        tokens_per_hash=int(c.cache.tokens_per_hash),
        blocks_per_chunk=int(c.cache.blocks_per_chunk),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        primary_row_bytes=int(primary_row_bytes),
        parallel=parallel,
        kv_cache_layout=c.kv_cache_layout,
        canonical_layout=bool(c.canonical_layout),
        replicated_layout=bool(c.replicated_layout),
        weights_version=config.weights_version,
    )


def parallel_sharing_note(layout: VllmLayout) -> Optional[str]:
    """The line a tier logs at start when its records cannot be shared across parallel layouts."""
    parallel = dict(layout.parallel)
    if parallel.get("parallelism_agnostic"):
        return None
    sizes = ", ".join(f"{k}={parallel[k]}" for k in ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size"))
    return (f"kvtier: records are bound to this parallel layout ({sizes}): vLLM reports the host KV bytes of "
            "this model as not parallelism-agnostic (it needs one full-attention, non-MLA group with KV heads "
            "split by TP and no context parallelism, or canonical_layout), so servers with another "
            "parallel layout will not hit them")
