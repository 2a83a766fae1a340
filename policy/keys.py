"""Chunk keys: what names one stored chunk, across processes, models and tenants.

Primitives: ``KeyChain`` (one request's keys, computed on demand and grown token by token),
``chunk_keys`` (every complete chunk's key, per group, as lists), ``layout_fingerprint`` (a canonical
tag of a layout plus the caller's model/dtype/shape/weights facts). Pure, no I/O. A ``KeyChain`` may
be read from several threads (its lazy state is guarded by a lock); the engine reads it on its loop.

Key format v2 (``KEY_FORMAT_VERSION``). One BLAKE3 stream per request: a header of typed,
length-prefixed parts (domain ``kvtier.chunk-key.v2``, the layout fingerprint, whether a tenant salt
is bound, every group's block and chunk size), then a tokens tag, then every token as 4 little-endian
bytes (token ids must lie in ``[0, 2**32)``). The tokens part is the last one and runs to the end of the hashed input, whose length BLAKE3
binds, so it needs no length prefix. With a tenant salt the stream is keyed (BLAKE3 keyed mode, key
derived from the salt), so two tenants never share a key and a crafted prompt cannot aim at another
tenant's chunk. The key of chunk ``c`` of group ``g`` (chunk size ``T``) is the 32 output bytes at
offset ``32 * g`` of the stream's extendable output over the prefix ``tokens[: (c + 1) * T]``: equal
keys mean equal prefixes, equal fingerprint, salt and layout, and the same group. Nothing here
depends on Python's ``hash`` or its seed.

Why a stream rather than v1's chain of one hash per chunk per group: a 131072-token prompt over a
layout with an 8-token chunk group made v1 compute ~19000 chained hashes (~38 ms on the event loop
per lookup). v2 hashes the tokens once, at native speed, and finalizes only the prefixes a caller
reads: full-attention groups' keys (every lookup, load and store needs them all) as the stream
passes their chunk ends, sliding-window groups' keys on demand from a checkpoint copy of the stream
state every ``_CHECKPOINT_TOKENS`` tokens. A request that grows by a block per step extends its
chain (``KeyChain.extended``) and pays for the new tokens only. v1 keys (``kvtier.chunk-key.v1``)
never equal v2 keys: caches written before v2 miss once, and their records age out by LRU or
``kvtier gc``.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
from array import array
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, overload

from blake3 import blake3

from .geometry import ModelLayout

__all__ = [
    "KeyChain",
    "chunk_keys",
    "layout_fingerprint",
    "KEY_BYTES",
    "KEY_FORMAT_VERSION",
    "TokenIds",
    "Fingerprint",
    "Salt",
    "salted_hasher",
]

KEY_BYTES = 32
KEY_FORMAT_VERSION = 2
_DOMAIN = b"kvtier.chunk-key.v2"
_SALT_CONTEXT = "kvtier 2026-11 tenant salt v1"
_TOKEN_BYTES = 4  # token ids are < 2**32 in every tokenizer; half the bytes of int64 to hash
# A stream-state copy costs ~2 us and ~2 KiB; one per 1024 tokens keeps an on-demand key within
# 4 KiB of hashing (a few us) for ~256 KiB of copies on a 131072-token request.
_CHECKPOINT_TOKENS = 1024

TokenIds = Union[Sequence[int], Iterable[int]]
Fingerprint = Union[bytes, str]
Salt = Union[bytes, str, None]

# Part tags: every part but the last is tag (1 byte) + length (8 bytes, little-endian) + bytes.
_TAG_DOMAIN, _TAG_FINGERPRINT, _TAG_SALTED, _TAG_GROUP, _TAG_PARENT, _TAG_TOKENS, _TAG_LAYOUT = range(1, 8)


def _part(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BQ", tag, len(payload)) + payload


def _as_bytes(name: str, value: Union[bytes, str]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ValueError(f"{name} must be bytes or str, got {type(value).__name__}")


def _hasher_factory(salt: Salt) -> Callable[..., blake3]:
    if salt is None:
        return blake3
    salt_bytes = _as_bytes("salt", salt)
    key = blake3(salt_bytes, derive_key_context=_SALT_CONTEXT).digest()
    return lambda data=b"": blake3(data, key=key)


def salted_hasher(salt: Salt) -> Callable[..., blake3]:
    """The BLAKE3 constructor chunk keys are hashed with: plain without a tenant salt, keyed (key
    derived from the salt) with one. Front ends that key other names (SGLang's page hashes) use it
    so a tenant salt separates their keys the same way."""
    return _hasher_factory(salt)


def _uint32_code() -> str:
    for code in ("I", "L"):
        if array(code).itemsize == _TOKEN_BYTES:
            return code
    raise ImportError("no 4-byte unsigned array type on this platform")  # pragma: no cover


_TOKEN_CODE = _uint32_code()
_TOKEN_LIMIT = 1 << (8 * _TOKEN_BYTES)


def _bad_token_error(token_ids: Iterable[object]) -> ValueError:
    """The precise complaint about the first unusable token (slow path, errors only)."""
    for token in token_ids:
        try:
            value = token.__index__()  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            return ValueError(f"token_ids must be integers in [0, 2**32), got {token!r}")
        if value < 0:
            return ValueError(f"token_ids must be non-negative, got {value}")
        if value >= _TOKEN_LIMIT:
            return ValueError(f"token_ids must be integers in [0, 2**32), got {value}")
    return ValueError("token_ids must be integers in [0, 2**32)")


def _token_array(token_ids: TokenIds) -> array:
    """Tokens as 4 little-endian bytes each; each must lie in ``[0, 2**32)`` (checked in C)."""
    if hasattr(token_ids, "tolist"):  # numpy arrays, torch tensors, array.array: unbox in C
        token_ids = token_ids.tolist()
    elif iter(token_ids) is token_ids:  # a one-shot iterator: keep it for the error message
        token_ids = list(token_ids)
    try:
        tokens = array(_TOKEN_CODE, token_ids)
    except (TypeError, OverflowError):
        raise _bad_token_error(token_ids) from None
    if sys.byteorder != "little":
        tokens.byteswap()  # keys must not depend on the machine
    return tokens


class _Spec:
    """What every chain of one (layout, fingerprint, salt) shares: the header state and strides."""

    __slots__ = ("header", "chunk_tokens", "eager_groups", "stride_tokens", "checkpoint_tokens", "salted")

    def __init__(self, layout: ModelLayout, fingerprint: Fingerprint, salt: Salt) -> None:
        fingerprint_bytes = _as_bytes("fingerprint", fingerprint)
        if not fingerprint_bytes:
            raise ValueError("fingerprint must not be empty")
        self.salted = salt is not None
        geometry = struct.pack("<Q", len(layout.groups)) + b"".join(
            struct.pack("<QQ", g.block_size, g.tokens_per_chunk) for g in layout.groups
        )
        self.header: blake3 = _hasher_factory(salt)(
            _part(_TAG_DOMAIN, _DOMAIN)
            + _part(_TAG_FINGERPRINT, fingerprint_bytes)
            + _part(_TAG_SALTED, b"\x01" if self.salted else b"\x00")
            + _part(_TAG_LAYOUT, geometry)
            + struct.pack("<B", _TAG_TOKENS)
        )
        self.chunk_tokens: Tuple[int, ...] = tuple(g.tokens_per_chunk for g in layout.groups)
        # Full-attention groups need every key of a request (lookup, load and store all walk them),
        # so their keys are finalized as the stream passes their chunk ends; the stream stops every
        # `stride_tokens` (their shared chunk multiple) to do so.
        self.eager_groups: Tuple[int, ...] = tuple(i for i, g in enumerate(layout.groups) if not g.is_sliding)
        eager_sizes = [self.chunk_tokens[i] for i in self.eager_groups]
        unit = math.gcd(*eager_sizes) if eager_sizes else math.gcd(*self.chunk_tokens)
        self.checkpoint_tokens = unit * max(1, -(-_CHECKPOINT_TOKENS // unit))
        self.stride_tokens = unit if eager_sizes else self.checkpoint_tokens


class _ChainState:
    """The append-only stream behind one or more ``KeyChain`` views (a longer view shares it)."""

    __slots__ = ("tokens", "frontier", "frontier_tokens", "checkpoints", "keys", "scratch", "scratch_tokens", "lock")

    def __init__(self, spec: _Spec, tokens: bytearray) -> None:
        self.tokens = tokens  # _TOKEN_BYTES per token; only ever appended to
        self.frontier = spec.header.copy()  # the stream over tokens[:frontier_tokens]
        self.frontier_tokens = 0
        self.checkpoints: List[blake3] = [spec.header]  # [i]: stream over tokens[: i * checkpoint_tokens]; never mutated
        count = len(tokens) // _TOKEN_BYTES
        self.keys: List[List[Optional[bytes]]] = [[None] * (count // t) for t in spec.chunk_tokens]
        self.scratch: Optional[blake3] = None  # a private copy left at scratch_tokens by the last on-demand key
        self.scratch_tokens = 0
        self.lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // _TOKEN_BYTES


class KeyChain:
    """One request's chunk keys, per group, computed when first read and then cached.

    ``chain.keys[g][c]`` (or ``chain.key(g, c)``) is the key of chunk ``c`` of group ``g``;
    ``len(chain.keys[g])`` is the number of complete chunks. ``extended(more_token_ids)`` returns the
    chain of the request grown by those tokens, sharing everything already hashed: O(new tokens).
    A chain is immutable from the outside; equal tokens, layout, fingerprint and salt give equal keys
    in any process (see the module docstring for the format).
    """

    __slots__ = ("layout", "num_tokens", "_spec", "_state", "_groups")

    def __init__(self, layout: ModelLayout, token_ids: TokenIds, *, fingerprint: Fingerprint, salt: Salt = None) -> None:
        spec = _Spec(layout, fingerprint, salt)
        self._init(layout, spec, _ChainState(spec, bytearray(_token_array(token_ids))), None)

    def _init(self, layout: ModelLayout, spec: _Spec, state: _ChainState, num_tokens: Optional[int]) -> None:
        self.layout = layout
        self._spec = spec
        self._state = state
        self.num_tokens: int = state.num_tokens if num_tokens is None else num_tokens
        self._groups = tuple(_GroupKeys(self, g, self.num_tokens // t) for g, t in enumerate(spec.chunk_tokens))

    @classmethod
    def _view(cls, layout: ModelLayout, spec: _Spec, state: _ChainState, num_tokens: int) -> "KeyChain":
        chain = cls.__new__(cls)
        chain._init(layout, spec, state, num_tokens)
        return chain

    @property
    def salted(self) -> bool:
        """Whether a tenant salt is bound into these keys."""
        return self._spec.salted

    @property
    def keys(self) -> Tuple["_GroupKeys", ...]:
        """Per group, the lazy sequence of its complete chunks' keys."""
        return self._groups

    def key(self, group_index: int, chunk_index: int) -> Optional[bytes]:
        """The key of one chunk, or ``None`` when the request has no such complete chunk."""
        group = self._groups[group_index]
        return group[chunk_index] if 0 <= chunk_index < len(group) else None

    def extended(self, more_token_ids: TokenIds) -> "KeyChain":
        """The chain of this request followed by ``more_token_ids``; ``self`` is unchanged.

        Costs the new tokens only when ``self`` is the longest chain over its stream (the usual
        decode step); extending an older view of the same stream copies its prefix once (a fork).
        """
        more = _token_array(more_token_ids)
        spec, state, length = self._spec, self._state, self.num_tokens
        with state.lock:
            if state.num_tokens != length:
                state = self._fork()
            state.tokens += more
            count = state.num_tokens
            for cache, size in zip(state.keys, spec.chunk_tokens):
                cache.extend([None] * (count // size - len(cache)))
        return KeyChain._view(self.layout, spec, state, count)

    def _fork(self) -> _ChainState:
        """A private stream for this view's prefix (called under the shared state's lock)."""
        spec, old, length = self._spec, self._state, self.num_tokens
        state = _ChainState.__new__(_ChainState)
        state.tokens = bytearray(memoryview(old.tokens)[: length * _TOKEN_BYTES])
        state.checkpoints = old.checkpoints[: length // spec.checkpoint_tokens + 1]
        state.keys = [cache[: length // size] for cache, size in zip(old.keys, spec.chunk_tokens)]
        state.scratch, state.scratch_tokens = None, 0
        state.lock = threading.Lock()
        if old.frontier_tokens <= length:
            state.frontier, state.frontier_tokens = old.frontier.copy(), old.frontier_tokens
        else:
            start = (length // spec.checkpoint_tokens) * spec.checkpoint_tokens
            state.frontier = state.checkpoints[-1].copy()
            with memoryview(state.tokens) as view:
                state.frontier.update(view[start * _TOKEN_BYTES : length * _TOKEN_BYTES])
            state.frontier_tokens = length
        return state

    # ------------------------------------------------------------------ hashing (under the lock)

    def _compute(self, group_index: int, chunk_index: int) -> bytes:
        state = self._state
        with state.lock:
            key = state.keys[group_index][chunk_index]
            if key is not None:
                return key
            end = (chunk_index + 1) * self._spec.chunk_tokens[group_index]
            if end >= state.frontier_tokens:
                self._advance(end)
                key = state.keys[group_index][chunk_index]
                if key is None:
                    key = state.frontier.digest(KEY_BYTES, seek=KEY_BYTES * group_index)
            else:
                key = self._stream_at(end).digest(KEY_BYTES, seek=KEY_BYTES * group_index)
            state.keys[group_index][chunk_index] = key
            return key

    def _fill(self, group_index: int, start: int, stop: int) -> List[Optional[bytes]]:
        """Compute keys ``[start, stop)`` of one group in ascending order with one private stream
        (what iterating a whole group costs: one update and one finalization per key)."""
        spec, state = self._spec, self._state
        size, seek, checkpoint = spec.chunk_tokens[group_index], KEY_BYTES * group_index, spec.checkpoint_tokens
        with state.lock:
            cache = state.keys[group_index]
            if stop * size > state.frontier_tokens:
                self._advance(stop * size)  # finalizes eager groups' keys, lays the checkpoints
            stream: Optional[blake3] = None
            position = 0
            with memoryview(state.tokens) as view:
                for chunk in range(start, stop):
                    if cache[chunk] is not None:
                        continue
                    end = (chunk + 1) * size
                    if stream is None:
                        position = (end // checkpoint) * checkpoint
                        stream = state.checkpoints[position // checkpoint].copy()
                    stream.update(view[position * _TOKEN_BYTES : end * _TOKEN_BYTES])
                    position = end
                    cache[chunk] = stream.digest(KEY_BYTES, seek=seek)
        return cache

    def _advance(self, target: int) -> None:
        """Move the frontier to ``target`` tokens, finalizing eager groups' keys and checkpointing."""
        spec, state = self._spec, self._state
        stride, checkpoint = spec.stride_tokens, spec.checkpoint_tokens
        eager = [(g, spec.chunk_tokens[g], state.keys[g]) for g in spec.eager_groups]
        frontier, position = state.frontier, state.frontier_tokens
        with memoryview(state.tokens) as view:
            while position < target:
                stop = min((position // stride + 1) * stride, target)
                frontier.update(view[position * _TOKEN_BYTES : stop * _TOKEN_BYTES])
                position = stop
                if stop % checkpoint == 0 and len(state.checkpoints) == stop // checkpoint:
                    state.checkpoints.append(frontier.copy())
                for g, size, cache in eager:
                    if stop % size == 0 and cache[stop // size - 1] is None:
                        cache[stop // size - 1] = frontier.digest(KEY_BYTES, seek=KEY_BYTES * g)
        state.frontier_tokens = position

    def _stream_at(self, end: int) -> blake3:
        """A stream state over ``tokens[:end]`` behind the frontier: from the scratch copy when it
        lies between the nearest checkpoint and ``end`` (ascending reads), else from a checkpoint."""
        spec, state = self._spec, self._state
        base = (end // spec.checkpoint_tokens) * spec.checkpoint_tokens
        if state.scratch is not None and base <= state.scratch_tokens <= end:
            stream, start = state.scratch, state.scratch_tokens
        else:
            checkpoint = state.checkpoints[base // spec.checkpoint_tokens]
            if base == end:
                return checkpoint  # finalizing does not modify it
            stream, start = checkpoint.copy(), base
        with memoryview(state.tokens) as view:
            stream.update(view[start * _TOKEN_BYTES : end * _TOKEN_BYTES])
        state.scratch, state.scratch_tokens = stream, end
        return stream


class _GroupKeys(Sequence[bytes]):
    """One group's keys of a ``KeyChain``: a read-only sequence that hashes on first read."""

    __slots__ = ("_chain", "_group", "_length", "_cache")

    def __init__(self, chain: KeyChain, group_index: int, length: int) -> None:
        self._chain = chain
        self._group = group_index
        self._length = length
        self._cache = chain._state.keys[group_index]  # shared list; grows only past `length`

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> List[bytes]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1 or start >= stop:
                return [self[i] for i in range(start, stop, step)]
            return self._chain._fill(self._group, start, stop)[start:stop]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"chunk index {index} out of range for {self._length} chunks")
        key = self._cache[index]
        return key if key is not None else self._chain._compute(self._group, index)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self[:])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (_GroupKeys, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<keys of group {self._group}: {self._length} chunks>"


def chunk_keys(
    layout: ModelLayout,
    token_ids: TokenIds,
    *,
    fingerprint: Fingerprint,
    salt: Salt = None,
) -> List[List[bytes]]:
    """Per group, the keys of its complete chunks of ``token_ids`` (chunk ``c`` at index ``c``).

    Chunk ``c`` of group ``g`` covers tokens ``[c*T, (c+1)*T)`` with ``T`` the group's chunk size;
    its key binds every earlier token too, so equal keys mean equal prefixes. Computes every key;
    ``KeyChain`` computes only those read.
    """
    chain = KeyChain(layout, token_ids, fingerprint=fingerprint, salt=salt)
    return [list(group) for group in chain.keys]


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
