"""Keys that outlive the process: vLLM's offload keys bound to what makes their bytes meaningful.

vLLM hands a secondary tier ``OffloadKey`` = block hash (chained from ``NONE_HASH``) + 4-byte group
index. The bytes behind a key also depend on things the hash does not cover: the model and its
weights, the KV layout of each group (layers, tokens per block, blocks per chunk, bytes per
block), the parallel rank layout (unless vLLM says the persisted bytes are the same under any
topology), and the primary row size. ``VllmLayout`` collects them; its ``fingerprint`` (BLAKE3 of
a canonical JSON of them) is every record's fingerprint, so a record read under another layout is
a mismatch, never bytes. The key scheme (vLLM's hash algorithm and ``NONE_HASH``) is bound later
(``with_key_scheme``): vLLM builds its secondary tiers before it seeds ``NONE_HASH``. The bound
layout's ``namespace`` keys the BLAKE3 that turns an offload key into kvtier's 32-byte chunk key.
Two servers with one layout and one key scheme share records; any difference gives disjoint keys.

Pure: no vLLM import (the tier and warmup fill ``VllmLayout`` from vLLM objects).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Mapping, Sequence, Tuple

import blake3

__all__ = [
    "VllmLayout",
    "GroupLayout",
    "NON_CRYPTO_HASH_ALGORITHMS",
    "LAYOUT_FILE_PREFIX",
    "offload_key",
    "split_offload_key",
]

NON_CRYPTO_HASH_ALGORITHMS = frozenset({"xxhash", "xxhash_cbor"})
LAYOUT_FILE_PREFIX = "vllm-layout-"


def offload_key(block_hash: bytes, group_index: int) -> bytes:
    """vLLM's ``make_offload_key``: block hash + group index as 4 big-endian bytes."""
    return bytes(block_hash) + int(group_index).to_bytes(4, "big", signed=False)


def split_offload_key(key: bytes) -> Tuple[bytes, int]:
    """(block hash, group index) of a vLLM offload key."""
    return bytes(key[:-4]), int.from_bytes(key[-4:], "big", signed=False)


@dataclass(frozen=True)
class GroupLayout:
    """One offloaded KV-cache group as vLLM's ``OffloadingGroupConfig`` describes it."""

    group_id: int
    tokens_per_block: int
    layer_names: Tuple[str, ...]
    sliding_window_size_in_chunks: Any = None


@dataclass(frozen=True)
class VllmLayout:
    """Everything that makes a vLLM offload key's bytes mean the same thing in another process."""

    model: str
    dtype: str
    groups: Tuple[GroupLayout, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int
    primary_row_bytes: int
    parallel: Mapping[str, Any] = field(default_factory=dict)
    kv_cache_layout: Any = None
    canonical_layout: bool = False
    replicated_layout: bool = False
    hash_algorithm: str = ""
    none_hash_hex: str = ""
    weights_version: str = ""

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): the namespace hashes exactly this."""
        return json.dumps(self._data(), sort_keys=True, separators=(",", ":"))

    def _data(self) -> Dict[str, Any]:
        data = asdict(self)
        data["groups"] = [dict(g, layer_names=list(g["layer_names"])) for g in data["groups"]]
        data["parallel"] = dict(self.parallel)
        return data

    @property
    def key_scheme_bound(self) -> bool:
        """Whether vLLM's hash algorithm and NONE_HASH are known (``with_key_scheme``)."""
        return bool(self.hash_algorithm) and bool(self.none_hash_hex)

    def with_key_scheme(self, hash_algorithm: str, none_hash: bytes) -> "VllmLayout":
        """This layout bound to the block hashes vLLM computes (its algorithm and seeded NONE_HASH)."""
        return dataclasses.replace(self, hash_algorithm=str(hash_algorithm), none_hash_hex=bytes(none_hash).hex())

    @classmethod
    def from_json(cls, text: str) -> "VllmLayout":
        data: Dict[str, Any] = json.loads(text)
        groups = tuple(
            GroupLayout(
                group_id=int(g["group_id"]),
                tokens_per_block=int(g["tokens_per_block"]),
                layer_names=tuple(g["layer_names"]),
                sliding_window_size_in_chunks=g.get("sliding_window_size_in_chunks"),
            )
            for g in data.pop("groups")
        )
        return cls(groups=groups, **data)

    @property
    def fingerprint(self) -> bytes:
        """32 bytes: what a record's bytes mean (everything but the key scheme); every record's
        fingerprint, known at construction (the remote tier binds its keys to it)."""
        data = self._data()
        del data["hash_algorithm"], data["none_hash_hex"]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return blake3.blake3(b"kvtier-vllm-records-v1\x00" + text.encode()).digest()

    @property
    def namespace(self) -> bytes:
        """32 bytes: the BLAKE3 key of every chunk key (the layout and the key scheme)."""
        if not self.key_scheme_bound:
            raise ValueError("this vLLM layout has no key scheme yet (with_key_scheme: vLLM's hash algorithm and NONE_HASH)")
        return blake3.blake3(b"kvtier-vllm-layout-v1\x00" + self.to_json().encode()).digest()

    @property
    def file_name(self) -> str:
        """Name of the JSON copy the tier leaves in its cache dir (read back by warmup)."""
        return f"{LAYOUT_FILE_PREFIX}{self.namespace.hex()[:16]}.json"

    def keys_outlive_process(self, pythonhashseed: "str | None") -> bool:
        """False when vLLM seeds NONE_HASH at random per process (xxhash without PYTHONHASHSEED)."""
        return self.hash_algorithm not in NON_CRYPTO_HASH_ALGORITHMS or pythonhashseed is not None

    def group_index(self, group_id: int) -> int:
        """Position of vLLM group ``group_id`` among the offloaded groups."""
        for index, group in enumerate(self.groups):
            if group.group_id == group_id:
                return index
        raise KeyError(group_id)

    def chunk_keys(self, offload_keys: Sequence[bytes]) -> list:
        """kvtier's 32-byte chunk key of each vLLM offload key (keyed BLAKE3, ~1 us each)."""
        ns = self.namespace
        return [blake3.blake3(bytes(k), key=ns).digest() for k in offload_keys]
