"""A trace seen through one layout: per request, the identity of every complete chunk of every group.

Primitives: ``Workload`` (``prepare(trace, layout)``), ``host_slots`` (the engine's per-group slot
counts for a host budget), ``record_bytes`` (what the LMDB tier counts per stored chunk), ``Plans``
(memoised store and load plans of the coverage contract). Pure; any thread.

Chunk identities are small ints, equal exactly when the engine's chunk keys are equal: a Mooncake
block id is a prefix hash, so the chunk of group ``g`` ending at token ``e`` is named by the chain
of block ids up to the block holding token ``e - 1`` (interned, so a trace that broke the prefix
property could not merge two chains), the offset of ``e`` in that block and ``g``. Prompts given as
token ids are keyed with kvtier's own ``KeyChain``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvtier.policy import KeyChain, ModelLayout
from kvtier.policy.plan import load_block_plan
from kvtier.policy.retention import check_retention_interval, retention_speculative_limit, retention_store_block_mask
from kvtier.tiers.host import host_slot_counts, host_split_weights

from .layouts import ReplayLayout
from .trace import Trace

__all__ = ["Workload", "Plans", "host_slots", "record_bytes", "scaled_layout", "REPLAY_FINGERPRINT"]

# What engine mode's records are bound to is a 32-byte layout fingerprint; only its length matters
# for the record header's size.
REPLAY_FINGERPRINT = bytes(32)


def host_slots(capacity_bytes: int, chunk_bytes: Sequence[int], plans: "Plans") -> List[int]:
    """Per group, the slots the engine's host pools get for ``capacity_bytes`` with chunks of
    ``chunk_bytes`` (the true sizes): ``tiers.host.host_slot_counts`` split by
    ``host_split_weights`` of the plans' layout and retention interval, as the engine splits it."""
    weights = host_split_weights(plans.layout, chunk_bytes, plans.retention)
    return host_slot_counts(capacity_bytes, chunk_bytes, weights)


def scaled_layout(layout: ReplayLayout, bytes_scale: float) -> ReplayLayout:
    """``layout`` with every chunk's payload scaled by ``bytes_scale`` (``--bytes-scale``), each
    record's header kept at its measured size."""
    if bytes_scale == 1:
        return layout
    overhead = [size - layout.chunk_bytes(g) for g, size in enumerate(record_bytes(layout, REPLAY_FINGERPRINT))]
    return layout.scaled(bytes_scale, overhead)


def record_bytes(layout: ReplayLayout, fingerprint: bytes) -> List[int]:
    """Per group, the bytes the LMDB tier counts for one stored chunk (record header + payload of
    incompressible KV), measured by encoding one with the engine's default codec."""
    from kvtier.engine import EngineConfig
    from kvtier.tiers.base import ChunkMeta
    from kvtier.tiers.record_format import encode_record

    codec = EngineConfig().codec_config()
    sizes = []
    for g, group in enumerate(layout.layout.groups):
        payload = layout.chunk_bytes(g)
        meta = ChunkMeta(fingerprint, g, 0, "uint8", (1, group.blocks_per_chunk, layout.block_bytes[g]))
        probe = min(payload, 4096)  # the header does not depend on the payload's size
        overhead = len(encode_record(bytes(32), meta, os.urandom(probe), codec)) - probe
        sizes.append(payload + overhead)
    return sizes


class Plans:
    """The coverage contract's per-request plans, memoised (they depend on token counts only):
    ``store(g, n)`` chunks a producer of ``n`` tokens stores under the retention interval,
    ``load(g, h)`` chunks a hit of ``h`` tokens reads."""

    def __init__(self, layout: ReplayLayout, retention_interval: Optional[int]) -> None:
        check_retention_interval(layout.layout, retention_interval)
        self.layout = layout.layout
        self.retention = retention_interval
        self._store: Dict[Tuple[int, int], Tuple[int, ...]] = {}
        self._load: Dict[Tuple[int, int], Tuple[int, ...]] = {}
        self._speculative: Dict[Tuple[int, int], Tuple[int, ...]] = {}

    def store(self, group_index: int, num_tokens: int) -> Tuple[int, ...]:
        key = (group_index, num_tokens)
        found = self._store.get(key)
        if found is None:
            found = self._store[key] = self._store_chunks(group_index, num_tokens)
        return found

    def _store_chunks(self, group_index: int, num_tokens: int) -> Tuple[int, ...]:
        """``retention_store_chunk_indices``: the policy's block mask, each complete chunk kept when
        any of its blocks is (numpy for that last step: a 4-token sliding group has a chunk per
        block, and a Python ``any`` per chunk was a third of a DeepSeek-V4 replay)."""
        group = self.layout.groups[group_index]
        if group.sliding_window is None:
            return tuple(range(num_tokens // group.tokens_per_chunk))
        mask = retention_store_block_mask(self.layout, group_index, num_tokens, self.retention)
        per_chunk = group.blocks_per_chunk
        complete = num_tokens // group.tokens_per_chunk
        if not complete:
            return ()
        blocks = np.asarray(mask[: complete * per_chunk], dtype=bool).reshape(complete, per_chunk)
        return tuple(np.flatnonzero(blocks.any(axis=1)).tolist())

    def speculative(self, group_index: int, num_tokens: int) -> Tuple[int, ...]:
        """Of ``store(g, n)``, the chunks only a partial-prefix hit reads (the engine stores them
        marked speculative: ``retention_speculative_limit``)."""
        key = (group_index, num_tokens)
        found = self._speculative.get(key)
        if found is None:
            limit = retention_speculative_limit(self.layout, group_index, num_tokens, self.retention)
            found = self._speculative[key] = tuple(c for c in self.store(group_index, num_tokens) if c < limit)
        return found

    def load(self, group_index: int, hit_tokens: int) -> Tuple[int, ...]:
        key = (group_index, hit_tokens)
        found = self._load.get(key)
        if found is None:
            found = self._load[key] = tuple(c for c, _ in load_block_plan(self.layout, group_index, hit_tokens))
        return found


class ChunkIds:
    """The chunk ids of one group of one request, computed when read (a list of ints for a
    sliding group of 4-token chunks would hold tens of millions): ``ids[c]`` and
    ``ids.take(chunks)``."""

    __slots__ = ("_canon", "_size", "_block", "_groups", "_group", "_count")

    def __init__(self, canon: List[int], chunk_tokens: int, block: int, groups: int, group: int, count: int) -> None:
        self._canon, self._size, self._block, self._groups, self._group, self._count = (
            canon, chunk_tokens, block, groups, group, count)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, chunk: int) -> int:
        end = (chunk + 1) * self._size - 1
        block = self._block
        return (self._canon[end // block] * block + end % block) * self._groups + self._group

    def take(self, chunks: Sequence[int]) -> List[int]:
        return [self[c] for c in chunks]


class KeyIds(list):
    """Chunk ids of one group of a prompt given as token ids (keyed by ``KeyChain``)."""

    def take(self, chunks: Sequence[int]) -> List[int]:
        return [self[c] for c in chunks]


@dataclass
class Workload:
    """``ids[r][g]``: the chunk ids (``ChunkIds`` / ``KeyIds``) of request ``r``'s complete chunks
    of group ``g``; ``tokens[r]``: its input length; ``all_chunks[g]``: distinct complete chunks
    of group ``g`` over the trace; ``unique_chunks[g]``: the distinct ones a dense store (every
    alignment boundary) with ``R = 0`` writes -- the basis of budgets given as shares, the same
    whatever ``R`` and retention a run uses (a sliding group's chunks outside every window, and
    DeepSeek-V4's per-token carry state, are never stored, so they do not count)."""

    trace: Trace
    layout: ReplayLayout
    ids: List[list]
    tokens: List[int]
    all_chunks: List[int]
    unique_chunks: List[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def input_tokens(self) -> int:
        return sum(self.tokens)

    def unique_bytes(self, per_chunk: Sequence[int]) -> int:
        """Bytes every distinct chunk of the trace takes at ``per_chunk[g]`` bytes each."""
        return sum(count * size for count, size in zip(self.unique_chunks, per_chunk))

    @classmethod
    def prepare(cls, trace: Trace, layout: ReplayLayout) -> "Workload":
        groups = layout.layout.groups
        num_groups = len(groups)
        block = trace.block_tokens
        chains: Dict[Tuple[int, int], int] = {}
        keyed: Dict[bytes, int] = {}
        ids: List[list] = []
        tokens: List[int] = []
        # Per group and block chain, the most chunk ends any request has inside that block.
        ends_in_block: List[List[Tuple[np.ndarray, np.ndarray]]] = [[] for _ in groups]
        for request in trace.requests:
            n = request.input_length
            tokens.append(n)
            if request.block_ids is not None:
                canon: List[int] = []
                previous = -1
                for h in request.block_ids.tolist():
                    previous = chains.setdefault((previous, h), len(chains))
                    canon.append(previous)
                starts = np.arange(len(canon), dtype=np.int64) * block
                his = np.minimum(starts + block, n)
                per_group = []
                for g, group in enumerate(groups):
                    size = group.tokens_per_chunk
                    per_group.append(ChunkIds(canon, size, block, num_groups, g, n // size))
                    ends_in_block[g].append((np.asarray(canon, dtype=np.int64), his // size - starts // size))
                ids.append(per_group)
            elif request.token_ids is not None:
                chain = KeyChain(layout.layout, request.token_ids.tolist(), fingerprint=b"kvtier-replay")
                ids.append([KeyIds(keyed.setdefault(k, len(keyed)) for k in chain.keys[g]) for g in range(num_groups)])
            else:
                raise ValueError(f"request {request.index} has neither block_ids nor token_ids")
        unique = []
        for g in range(num_groups):
            count = len({i for request in ids if isinstance(request[g], KeyIds) for i in request[g]})
            if ends_in_block[g]:
                most = np.zeros(len(chains), dtype=np.int64)
                for chain_ids, counts in ends_in_block[g]:
                    np.maximum.at(most, chain_ids, counts)
                count += int(most.sum())
            unique.append(count)
        work = cls(trace, layout, ids, tokens, unique)
        model = layout.layout
        dense = Plans(replace(layout, layout=ModelLayout(
            tuple(replace(g, extra_retained_tokens=0) for g in model.groups),
            alignment_tokens=model.alignment_tokens, hit_granularity_tokens=model.hit_granularity_tokens)), None)
        work.unique_chunks = [
            len({key for r, n in enumerate(tokens) for key in ids[r][g].take(dense.store(g, n))})
            for g in range(num_groups)]
        return work
