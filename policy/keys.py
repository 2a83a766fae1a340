"""Chunk keys: what names one stored chunk, across processes, models and tenants.

Primitives: ``chunk_keys`` (every complete chunk's key, per group), ``layout_fingerprint`` (a
canonical tag of a layout plus the caller's model/dtype/shape/weights facts). Pure; any thread.

A key is the 32-byte BLAKE3 digest of typed, length-prefixed parts: the layout fingerprint, the
group index and its chunk size, and the chained hash of every token up to the chunk's end. With a
tenant salt the hash is keyed (BLAKE3 keyed mode, key derived from the salt), so two tenants, two
models or two groups never share a key and a crafted prompt cannot aim at another tenant's chunk.
Nothing here depends on Python's ``hash`` or its seed.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Iterable, List, Optional, Sequence, Union

from blake3 import blake3

from .geometry import ModelLayout

__all__ = ["chunk_keys", "layout_fingerprint", "KEY_BYTES", "TokenIds", "Fingerprint", "Salt"]

KEY_BYTES = 32
_DOMAIN = b"kvtier.chunk-key.v1"
_SALT_CONTEXT = "kvtier 2026-11 tenant salt v1"

TokenIds = Union[Sequence[int], Iterable[int]]
Fingerprint = Union[bytes, str]
Salt = Union[bytes, str, None]

# Part tags: every part is tag (1 byte) + length (8 bytes, little-endian) + bytes.
_TAG_DOMAIN, _TAG_FINGERPRINT, _TAG_SALTED, _TAG_GROUP, _TAG_PARENT, _TAG_TOKENS = range(1, 7)


def _part(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BQ", tag, len(payload)) + payload


def _as_bytes(name: str, value: Union[bytes, str]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ValueError(f"{name} must be bytes or str, got {type(value).__name__}")


def _hasher_factory(salt: Salt):
    if salt is None:
        return blake3
    salt_bytes = _as_bytes("salt", salt)
    key = blake3(salt_bytes, derive_key_context=_SALT_CONTEXT).digest()
    return lambda data=b"": blake3(data, key=key)


def _token_array(token_ids: TokenIds) -> array:
    try:
        tokens = array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token_ids must be integers in the int64 range: {exc}") from None
    if tokens and min(tokens) < 0:
        raise ValueError(f"token_ids must be non-negative, got {min(tokens)}")
    if sys.byteorder != "little":
        tokens.byteswap()  # keys must not depend on the machine
    return tokens


def chunk_keys(
    layout: ModelLayout,
    token_ids: TokenIds,
    *,
    fingerprint: Fingerprint,
    salt: Salt = None,
) -> List[List[bytes]]:
    """Per group, the keys of its complete chunks of ``token_ids`` (chunk ``c`` at index ``c``).

    Chunk ``c`` of group ``g`` covers tokens ``[c*T, (c+1)*T)`` with ``T`` the group's chunk size;
    its key chains the hash of every earlier chunk, so equal keys mean equal prefixes.
    """
    fingerprint_bytes = _as_bytes("fingerprint", fingerprint)
    if not fingerprint_bytes:
        raise ValueError("fingerprint must not be empty")
    new_hasher = _hasher_factory(salt)
    tokens = _token_array(token_ids)
    raw = memoryview(tokens).cast("B")
    item = tokens.itemsize
    salted = b"\x01" if salt is not None else b"\x00"
    result: List[List[bytes]] = []
    for group_index, group in enumerate(layout.groups):
        tokens_per_chunk = group.tokens_per_chunk
        parent = new_hasher(
            _part(_TAG_DOMAIN, _DOMAIN)
            + _part(_TAG_FINGERPRINT, fingerprint_bytes)
            + _part(_TAG_SALTED, salted)
            + _part(_TAG_GROUP, struct.pack("<QQQ", group_index, group.block_size, tokens_per_chunk))
        ).digest()
        keys: List[bytes] = []
        chunk_bytes = tokens_per_chunk * item
        for chunk in range(len(tokens) // tokens_per_chunk):
            hasher = new_hasher(_part(_TAG_PARENT, parent))
            hasher.update(struct.pack("<BQ", _TAG_TOKENS, chunk_bytes))
            hasher.update(raw[chunk * chunk_bytes : (chunk + 1) * chunk_bytes])
            parent = hasher.digest()
            keys.append(parent)
        result.append(keys)
    return result


def layout_fingerprint(layout: ModelLayout, *, model: str, dtype: str, shapes: Sequence[Sequence[int]] = (), weights_version: str = "") -> bytes:
    """A canonical fingerprint of a layout and the model facts that change KV bytes.

    Two processes that agree on model, dtype, per-group KV shapes, weights version and layout get
    the same 32 bytes; any difference gives different keys.
    """
    parts = [f"model={model}", f"dtype={dtype}", f"weights={weights_version}"]
    for index, group in enumerate(layout.groups):
        parts.append(
            f"group{index}=b{group.block_size}/p{group.blocks_per_chunk}/w{group.sliding_window}"
            f"/r{group.extra_retained_tokens}/e{int(group.is_eagle)}"
        )
    for index, shape in enumerate(shapes):
        parts.append(f"shape{index}=" + "x".join(str(int(d)) for d in shape))
    parts.append(f"alignment={layout.alignment_tokens}")
    hasher = blake3(_part(_TAG_DOMAIN, b"kvtier.layout-fingerprint.v1"))
    for text in parts:
        hasher.update(_part(_TAG_FINGERPRINT, text.encode("utf-8")))
    return hasher.digest()
