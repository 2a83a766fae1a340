"""Records named by short strings, for store and listing tests: the key is the name's hash, the
payload the key repeated, so a test can build, find and check records by name."""

from __future__ import annotations

import hashlib
from typing import List, Tuple

from kvtier.tiers.base import ChunkMeta


def name_key(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=32).digest()


def named_items(names: List[str], fingerprint: bytes, chunk_bytes: int) -> List[Tuple[bytes, ChunkMeta, memoryview]]:
    """(key, meta, payload) of each name, in order; ``chunk_bytes`` a multiple of 32."""
    out = []
    for i, name in enumerate(names):
        key = name_key(name)
        out.append((key, ChunkMeta(fingerprint, 0, i, "uint8", (chunk_bytes,)), memoryview(key * (chunk_bytes // 32))))
    return out


def named_keys(names: List[str]) -> set:
    return {name_key(name) for name in names}
