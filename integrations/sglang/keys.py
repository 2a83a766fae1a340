"""Keys that outlive the process: SGLang's page hashes bound to what makes a page's bytes meaningful.

SGLang names a page by its hash string (``get_hash_str``: SHA-256 chained over the page's tokens
from the sequence start). The bytes behind it also depend on what the hash does not cover: the
model and its weights, the rank's shard of the KV (tensor, pipeline, context and decode-context
parallel ranks, except where SGLang says the pool is rank-replicated, as MLA is), and the host
pool the page comes from: its name (kv, swa, draft, ...), class, memory layout, dtype, page size,
bytes per page and SGLang's own page-format tag. ``PoolBinding`` collects them; its ``namespace``
(BLAKE3 of their canonical JSON) is every record's fingerprint, so a record read under another
binding is a mismatch, never bytes, and ``page_key`` turns a page hash into kvtier's 32-byte key
(BLAKE3 keyed by the tenant salt when there is one, ``kvtier.policy.keys.salted_hasher``). Two
servers with one binding share records; any difference gives disjoint keys.

Pure: no SGLang import (the backend fills ``PoolBinding`` from SGLang's objects).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

import blake3

from kvtier.policy.keys import salted_hasher

__all__ = ["PoolBinding", "PageKeys"]

_NAMESPACE_DOMAIN = b"kvtier-sglang-pool-v1\x00"
_KEY_DOMAIN = b"kvtier-sglang-page-v1\x00"


@dataclass(frozen=True)
class PoolBinding:
    """Everything that makes one pool's page under one hash mean the same bytes in another process.

    ``shard``: the parallel ranks the pool's bytes depend on (empty for a rank-replicated pool).
    ``page_numel`` / ``page_bytes``: one page as the pool's ``get_dummy_flat_data_page`` shapes it.
    """

    model: str
    weights_version: str
    pool: str
    pool_class: str
    layout: str
    dtype: str
    page_size: int
    page_numel: int
    page_bytes: int
    format_tag: Optional[str]
    shard: str

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): the namespace hashes exactly this."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def namespace(self) -> bytes:
        """32 bytes: every record's fingerprint, and the prefix of every page key of this pool."""
        return blake3.blake3(_NAMESPACE_DOMAIN + self.to_json().encode()).digest()


class PageKeys:
    """kvtier's record key of each page hash of one pool: ``H(domain | namespace | hash)`` with
    ``H`` BLAKE3 keyed by the tenant salt (plain without one); ~1 us a key, any thread."""

    __slots__ = ("binding", "namespace", "_hasher")

    def __init__(self, binding: PoolBinding, tenant_salt: Optional[str]) -> None:
        self.binding = binding
        self.namespace = binding.namespace
        self._hasher: Callable[..., "blake3.blake3"] = salted_hasher(tenant_salt)

    def page_key(self, page_hash: str) -> bytes:
        # The namespace is 32 bytes, so the hash after it needs no length prefix.
        return self._hasher(_KEY_DOMAIN + self.namespace + page_hash.encode("utf-8")).digest()

    def page_keys(self, page_hashes: Sequence[str]) -> List[bytes]:
        return [self.page_key(h) for h in page_hashes]
