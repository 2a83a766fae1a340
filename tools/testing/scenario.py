"""Scripted producer/consumer scenarios against an engine, with exact expectations.

Primitives: ``OffloadScenario`` (drives requests, checks stored and loaded ``(group, block)`` sets
and every restored byte), ``make_cpu_device`` (CPU KV tensors for a layout), ``DEFAULT_TEST_LAYOUT``.
Runs on the test's event loop.

The seed's testing style: "store and load expectations mirror each other". A producer fills its
device blocks with random bytes, stores, and the scenario remembers each stored chunk's bytes by
key; the device blocks are then dropped (zeroed and freed). A consumer allocates fresh blocks, looks
up, loads, and the scenario checks the loaded blocks against the producer's bytes bitwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.device_backend import DeviceBackend

__all__ = ["OffloadScenario", "ProducerRecord", "ConsumerRecord", "make_cpu_device", "DEFAULT_TEST_LAYOUT"]

# The seed scenario's layout: full attention (block 16) + sliding window (block 4, W 8, MTP R 3).
DEFAULT_TEST_LAYOUT = ModelLayout(
    groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8, extra_retained_tokens=3))
)

GroupBlocks = Dict[int, Set[int]]


def make_cpu_device(
    layout: ModelLayout,
    *,
    num_blocks: int = 256,
    num_layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 4,
    dtype: torch.dtype = torch.float32,
    backend: Optional[DeviceBackend] = None,
) -> DeviceKVView:
    """CPU paged KV tensors for ``layout``: per group ``num_layers`` tensors of shape
    ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (K and V stacked), zero-filled. ``backend``:
    a CPU backend of the caller's (``RecordingBackend`` runs the CUDA code path)."""
    caches = [
        [torch.zeros(num_blocks, 2, g.block_size, kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        for g in layout.groups
    ]
    return DeviceKVView(layout, caches, backend=backend)


def _as_sets(expected: Optional[Mapping[int, Iterable[int]]], num_groups: int) -> Optional[GroupBlocks]:
    if expected is None:
        return None
    return {g: set(expected.get(g, ())) for g in range(num_groups)}


@dataclass
class ProducerRecord:
    token_ids: List[int]
    block_table: List[List[int]]
    stored: GroupBlocks
    skipped: GroupBlocks
    dropped: GroupBlocks
    durable: bool


@dataclass
class ConsumerRecord:
    token_ids: List[int]
    hit: Optional[int]
    block_table: List[List[int]]
    loaded: GroupBlocks = field(default_factory=dict)
    ok: bool = False
    reason: Optional[str] = None


class OffloadScenario:
    """Drives producer and consumer requests against ``engine`` (an entered ``OffloadEngine`` whose
    device view holds CPU tensors) and asserts exact expectations.

    ``expect_stored`` / ``expect_loaded`` map group index -> logical block indices; a group left out
    expects the empty set. Failures raise ``AssertionError`` with both sets in the message.
    """

    def __init__(self, engine, *, seed: int = 0) -> None:
        self.engine = engine
        self.device: DeviceKVView = engine.device
        self.layout: ModelLayout = engine.layout
        self._rng = random.Random(seed)
        self._gen = torch.Generator().manual_seed(seed)
        groups = range(len(self.layout.groups))
        # Block 0 of every group stays unused: it plays the serving process's null block.
        self._free: List[List[int]] = [list(range(self.device.num_blocks(g) - 1, 0, -1)) for g in groups]
        # What producers stored, by chunk key: per block of the chunk, every layer's bytes. Hand it to
        # the scenario of a restarted engine (``later.producer_bytes = earlier.producer_bytes``) so its
        # consumers are checked against the bytes written before the restart.
        self.producer_bytes: Dict[bytes, List[List[torch.Tensor]]] = {}

    # ---------------------------------------------------------------- helpers

    def tokens(self, count: int, *, prefix: Sequence[int] = (), vocab: int = 32000) -> List[int]:
        """``prefix`` followed by random token ids, ``count`` in all."""
        extra = [self._rng.randrange(vocab) for _ in range(count - len(prefix))]
        return list(prefix) + extra

    def allocate(self, num_tokens: int) -> List[List[int]]:
        """A block table with one fresh device block per logical block covering ``num_tokens``."""
        table = []
        for g, group in enumerate(self.layout.groups):
            count = -(-num_tokens // group.block_size)
            if len(self._free[g]) < count:
                raise RuntimeError(f"scenario device has no {count} free blocks in group {g}")
            table.append([self._free[g].pop() for _ in range(count)])
        return table

    def free(self, block_table: Sequence[Sequence[int]]) -> None:
        """Drop device blocks: zero them and return them to the free list."""
        for g, blocks in enumerate(block_table):
            for block in blocks:
                for layer in self._layers(g):
                    layer[block].zero_()
                self._free[g].append(block)

    def _layers(self, group_index: int) -> List[torch.Tensor]:
        return list(self.device._groups[group_index].layers)

    def _block_bytes(self, group_index: int, block: int) -> List[torch.Tensor]:
        return [layer[block].clone().view(torch.uint8) for layer in self._layers(group_index)]

    def _blocks_of_chunks(self, chunks) -> GroupBlocks:
        result: GroupBlocks = {g: set() for g in range(len(self.layout.groups))}
        for g, chunk in chunks:
            per_chunk = self.layout.groups[g].blocks_per_chunk
            result[g].update(range(chunk * per_chunk, (chunk + 1) * per_chunk))
        return result

    # ---------------------------------------------------------------- producer

    async def produce(
        self,
        token_ids: Sequence[int],
        *,
        num_tokens: Optional[int] = None,
        salt=None,
        expect_stored: Optional[Mapping[int, Iterable[int]]] = None,
        wait_durable: bool = True,
        drop_device_blocks: bool = True,
    ) -> ProducerRecord:
        """Fill fresh device blocks with random bytes, store them, and (by default) wait until the
        chunks are durable, then drop the device blocks. Checks ``expect_stored`` exactly."""
        token_ids = list(token_ids)
        table = self.allocate(len(token_ids))
        keys = self.engine.request_keys(token_ids, salt=salt)
        self.fill_blocks(keys, table)
        handle = self.engine.store(keys, table, num_tokens)
        await handle.wait_released()
        for g, chunk in handle.scheduled:
            per_chunk = self.layout.groups[g].blocks_per_chunk
            self.producer_bytes[keys.keys[g][chunk]] = [
                self._block_bytes(g, table[g][b]) for b in range(chunk * per_chunk, (chunk + 1) * per_chunk)
            ]
        durable = await handle.wait_durable() if wait_durable else False
        record = ProducerRecord(
            token_ids,
            table,
            self._blocks_of_chunks(handle.scheduled),
            self._blocks_of_chunks(handle.skipped),
            self._blocks_of_chunks(handle.dropped),
            durable,
        )
        expected = _as_sets(expect_stored, len(self.layout.groups))
        if expected is not None:
            assert record.stored == expected, f"stored {record.stored} != expected {expected}"
        if drop_device_blocks:
            self.free(table)
        return record

    def fill_blocks(self, keys, table: Sequence[Sequence[int]]) -> None:
        """A producer's "forward pass": write its KV bytes into its device blocks. Here random
        bytes (random bytes can spell NaN; the checks compare bytes, so that is fine); a subclass
        may make them a function of the chunk keys, as a real model's KV is of the prefix."""
        for g, blocks in enumerate(table):
            for layer in self._layers(g):
                for block in blocks:
                    noise = torch.randint(0, 256, (layer[block].numel() * layer.element_size(),),
                                          dtype=torch.uint8, generator=self._gen)
                    layer[block].view(torch.uint8).view(-1).copy_(noise)

    # ---------------------------------------------------------------- consumer

    async def consume(
        self,
        token_ids: Sequence[int],
        *,
        salt=None,
        max_tokens: Optional[int] = None,
        expect_hit: Optional[int] = -1,
        expect_loaded: Optional[Mapping[int, Iterable[int]]] = None,
        free_after: bool = True,
        allow_failed_load: bool = False,
    ) -> ConsumerRecord:
        """Look up, allocate fresh (zeroed) device blocks, load the hit, and check: the hit equals
        ``expect_hit`` (pass -1 to accept any), the loaded (group, block) set equals
        ``expect_loaded``, and every loaded block equals the producer's bytes bitwise. With
        ``allow_failed_load`` a load that answers ``ok=False`` is returned as it is (``ok`` and
        ``reason`` say why; nothing of it is checked), as a server would recompute it."""
        token_ids = list(token_ids)
        keys = self.engine.request_keys(token_ids, salt=salt)
        hit = self.engine.lookup(keys, max_tokens)
        if expect_hit != -1:
            assert hit == expect_hit, f"lookup hit {hit} != expected {expect_hit}"
        table = self.allocate(len(token_ids))
        record = ConsumerRecord(token_ids, hit, table)
        if hit:
            result = await self.engine.load(keys, hit, table)
            record.ok, record.reason = result.ok, result.reason
            if not result.ok and allow_failed_load:
                if free_after:
                    self.free(table)
                return record
            assert result.ok, f"load of hit {hit} failed: {result.reason}"
            record.loaded = {g: set() for g in range(len(self.layout.groups))}
            for g, block in result.loaded:
                record.loaded[g].add(block)
            self._check_bytes(keys, table, record.loaded)
        expected = _as_sets(expect_loaded, len(self.layout.groups))
        if expected is not None:
            loaded = record.loaded or {g: set() for g in range(len(self.layout.groups))}
            assert loaded == expected, f"loaded {loaded} != expected {expected}"
        if free_after:
            self.free(table)
        return record

    def _check_bytes(self, keys, table, loaded: GroupBlocks) -> None:
        for g, blocks in loaded.items():
            per_chunk = self.layout.groups[g].blocks_per_chunk
            for block in blocks:
                chunk, offset = divmod(block, per_chunk)
                key = keys.keys[g][chunk]
                if key not in self.producer_bytes:
                    raise AssertionError(f"group {g} block {block}: loaded but no producer stored its chunk")
                want = self.producer_bytes[key][offset]
                got = self._block_bytes(g, table[g][block])
                for layer, (a, b) in enumerate(zip(want, got)):
                    if not torch.equal(a, b):
                        raise AssertionError(f"group {g} block {block} layer {layer}: loaded bytes differ")
