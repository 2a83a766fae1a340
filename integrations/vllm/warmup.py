"""Offline keys a vLLM server will compute, and what a kvtier cache holds under them.

``vllm_chunk_keys`` hashes a prompt the way vLLM 0.33's engine does, with vLLM's own code: the
hash function named in the layout, ``init_none_hash`` (so ``PYTHONHASHSEED`` / the default seed
apply as in the server), ``get_request_block_hasher`` at the layout's ``tokens_per_hash``, and a
real ``vllm.v1.request.Request`` (so ``cache_salt`` and vLLM's other extra keys enter the hash as
they do in the server). Its offload keys are the last block hash of each chunk + the group index,
exactly as vLLM's offloading scheduler forms them; the kvtier keys bind them to the layout.

``warm_through_vllm`` fills a cache offline by running prompts through vLLM's own scheduler and
connector on CPU (``testing.VllmCpuRig``): the records are then in vLLM's own row layout by
construction. ``cache_coverage`` reads a cache and says, per prompt, how many leading chunks of each
group a server's first request would find (``kvtier warmup --key-scheme vllm``).

Runs on the caller's thread; ``cache_coverage`` opens the LMDB read-only on its own event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvtier.errors import KvtierError
from kvtier.tiers.lmdb import LmdbTier

from .keys import LAYOUT_FILE_PREFIX, VllmLayout, offload_key

__all__ = ["VllmChunkKey", "vllm_chunk_keys", "load_layout", "cache_coverage", "warm_through_vllm"]


class VllmKeySchemeError(KvtierError, ValueError):
    """The vLLM key scheme cannot be reproduced here (another NONE_HASH seed, no layout file)."""


@dataclass(frozen=True)
class VllmChunkKey:
    group_id: int
    chunk_index: int
    end_token: int
    offload_key: bytes
    chunk_key: bytes


def load_layout(path: Union[str, "os.PathLike[str]"]) -> VllmLayout:
    """The layout JSON a ``KvtierTier`` left in its cache dir (or that file's directory)."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob(f"{LAYOUT_FILE_PREFIX}*.json"))
        if len(found) != 1:
            raise VllmKeySchemeError(
                f"{p} holds {len(found)} {LAYOUT_FILE_PREFIX}*.json files; pass --vllm-layout FILE "
                "(a vLLM server with KvtierTier leaves one per model layout in its cache_dir)"
            )
        p = found[0]
    try:
        return VllmLayout.from_json(p.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VllmKeySchemeError(f"cannot read the vLLM layout {p}: {exc}") from exc


def _block_hasher(layout: VllmLayout):
    hash_fn = get_hash_fn_by_name(layout.hash_algorithm)
    init_none_hash(hash_fn)
    none_hash = bytes(kv_cache_utils.NONE_HASH)
    if layout.none_hash_hex and none_hash.hex() != layout.none_hash_hex:
        raise VllmKeySchemeError(
            "this process derives another NONE_HASH than the server did: run with the server's "
            "PYTHONHASHSEED (or none, if the server had none and hashes with sha256)"
        )
    return get_request_block_hasher(layout.tokens_per_hash, hash_fn)


def vllm_chunk_keys(token_ids: Sequence[int], layout: VllmLayout, *, cache_salt: Optional[str] = None) -> List[VllmChunkKey]:
    """Every complete chunk's keys for one prompt, per offloaded group, in chunk order."""
    request = Request(request_id="kvtier-warmup", prompt_token_ids=list(token_ids),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      block_hasher=_block_hasher(layout), cache_salt=cache_salt)
    hashes = list(request.block_hashes)
    out: List[VllmChunkKey] = []
    for group in layout.groups:
        tokens_per_chunk = group.tokens_per_block * layout.blocks_per_chunk
        per_chunk = tokens_per_chunk // layout.tokens_per_hash
        offload = [offload_key(h, group.group_id) for h in hashes[per_chunk - 1 :: per_chunk]]
        for index, (ok, ck) in enumerate(zip(offload, layout.chunk_keys(offload))):
            out.append(VllmChunkKey(group.group_id, index, (index + 1) * tokens_per_chunk, ok, ck))
    return out


def cache_coverage(cache_dir: Union[str, "os.PathLike[str]"], layout: VllmLayout, prompts: Sequence[Sequence[int]], *,
                   cache_salt: Optional[str] = None) -> List[Dict[int, Dict[str, int]]]:
    """Per prompt, per group id: ``chunks`` complete chunks, ``present`` how many of them the cache
    holds, ``leading`` how many leading ones in a row (vLLM's prefix hits need the leading run for
    full attention; sliding-window groups need only the window at the hit)."""

    async def present(keys: List[bytes]) -> List[bool]:
        tier = await LmdbTier.open(cache_dir, readonly=True)
        try:
            return await tier.contains_many(keys)
        finally:
            await tier.close()

    per_prompt = [vllm_chunk_keys(p, layout, cache_salt=cache_salt) for p in prompts]
    flags = asyncio.run(present([k.chunk_key for keys in per_prompt for k in keys]))
    report: List[Dict[int, Dict[str, int]]] = []
    cursor = 0
    for keys in per_prompt:
        groups: Dict[int, Dict[str, int]] = {}
        for key in keys:
            entry = groups.setdefault(key.group_id, {"chunks": 0, "present": 0, "leading": 0})
            here = flags[cursor]
            cursor += 1
            entry["chunks"] += 1
            entry["present"] += int(here)
            if here and entry["leading"] == key.chunk_index:
                entry["leading"] += 1
        report.append(groups)
    return report


def warm_through_vllm(rig, prompts: Sequence[Sequence[int]], *, cache_salt: Optional[str] = None) -> int:
    """Run each prompt through ``rig`` (a ``testing.VllmCpuRig`` whose secondary tier is a
    ``KvtierTier`` on the cache to warm); returns the chunks stored. vLLM's own connector decides
    what to store and lays out the rows, so a server with the same layout hits them."""
    stored = 0
    for prompt in prompts:
        record = rig.run(list(prompt), cache_salt=cache_salt)
        stored += sum(len(blocks) for blocks in record.stored.values())
    return stored


def coverage_json(report: List[Dict[int, Dict[str, int]]]) -> str:
    return json.dumps([{str(g): v for g, v in groups.items()} for groups in report], sort_keys=True)
