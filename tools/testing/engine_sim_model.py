"""The model the engine simulation (``engine_sim``) checks the engine against: the simulated
serving process's device blocks (a free list per group, freed blocks sentinel-filled, chunk bytes a
pure function of key, block and layer: ``SimDevice``) and the tier's history as the engine hears it
(puts that landed, removal reports, host evictions, promises of durability: ``History``, with
``Moment`` and ``Promise`` the points in it a check is made against). Runs on the simulation's event
loop; ``SimViolation`` says which invariant broke.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from kvtier.engine import OffloadEngine

__all__ = ["SENTINEL", "SimViolation", "SimDevice", "Moment", "Promise", "History"]

SENTINEL = 0xA5


class SimViolation(AssertionError):
    """An invariant of the engine's contract broke during a simulation."""


class SimDevice:
    """The simulated serving process's device blocks: a free list per group, sentinel-filled."""

    def __init__(self, engine: OffloadEngine, rng: random.Random) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.layers = [list(engine.device._groups[g].layers) for g in range(len(self.layout.groups))]
        self.free: List[List[int]] = []
        for g in range(len(self.layout.groups)):
            blocks = list(range(1, engine.device.num_blocks(g)))
            rng.shuffle(blocks)
            self.free.append(blocks)
            for layer in self.layers[g]:
                layer.view(torch.uint8).fill_(SENTINEL)
        self._content: Dict[Tuple[bytes, int, int], torch.Tensor] = {}

    def allocate(self, num_tokens: int) -> Optional[List[List[int]]]:
        table: List[List[int]] = []
        for g, group in enumerate(self.layout.groups):
            count = -(-num_tokens // group.block_size)
            if len(self.free[g]) < count:
                for taken, blocks in enumerate(table):
                    self.free[taken].extend(blocks)
                return None
            table.append([self.free[g].pop() for _ in range(count)])
        return table

    def release(self, table: Sequence[Sequence[int]]) -> None:
        for g, blocks in enumerate(table):
            for block in blocks:
                for layer in self.layers[g]:
                    layer[block].view(torch.uint8).fill_(SENTINEL)
                self.free[g].append(block)

    def content(self, key: bytes, offset: int, layer: int, g: int) -> torch.Tensor:
        """The bytes every writer of chunk ``key`` puts in block ``offset`` of it, layer ``layer``."""
        cached = self._content.get((key, offset, layer))
        if cached is None:
            nbytes = self.layers[g][layer][0].numel() * self.layers[g][layer].element_size()
            seed = int.from_bytes(hashlib.blake2b(key + bytes([offset, layer]), digest_size=8).digest(), "little")
            data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
            cached = torch.from_numpy(data)
            self._content[(key, offset, layer)] = cached
        return cached

    def chunk_bytes(self, key: bytes, g: int) -> torch.Tensor:
        """Chunk ``key``'s bytes as a host slot holds them: layer-major, then block of the chunk."""
        per_chunk = self.layout.groups[g].blocks_per_chunk
        return torch.cat([self.content(key, off, li, g) for li in range(len(self.layers[g]))
                          for off in range(per_chunk)])

    def fill(self, keys, table, num_tokens: int) -> None:
        """Write each complete chunk's content into its blocks (what the model's forward would)."""
        for g, group in enumerate(self.layout.groups):
            per_chunk = group.blocks_per_chunk
            for chunk, key in enumerate(keys.keys[g]):
                for offset in range(per_chunk):
                    block = chunk * per_chunk + offset
                    if block >= len(table[g]):
                        break
                    for li, layer in enumerate(self.layers[g]):
                        layer[table[g][block]].view(torch.uint8).view(-1).copy_(self.content(key, offset, li, g))

    def expect(self, keys, table, loaded, seed: int) -> int:
        checked = 0
        for g, block in loaded:
            per_chunk = self.layout.groups[g].blocks_per_chunk
            chunk, offset = divmod(block, per_chunk)
            key = keys.keys[g][chunk]
            for li, layer in enumerate(self.layers[g]):
                got = layer[table[g][block]].view(torch.uint8).reshape(-1)
                if not torch.equal(got, self.content(key, offset, li, g)):
                    raise SimViolation(
                        f"seed {seed}: group {g} logical block {block} (device block {table[g][block]}) "
                        f"layer {li} holds bytes that are not its chunk's"
                    )
                checked += 1
        return checked

    def check_free(self, seed: int) -> None:
        for g, blocks in enumerate(self.free):
            for block in blocks:
                for li, layer in enumerate(self.layers[g]):
                    data = layer[block].view(torch.uint8)
                    if int(data.min()) != SENTINEL or int(data.max()) != SENTINEL:
                        raise SimViolation(
                            f"seed {seed}: free device block {block} of group {g} (layer {li}) was written "
                            "after the simulation released it"
                        )


@dataclass
class Moment:
    """A point in the history: its clock, and the last put sequence of each key of interest."""

    clock: int
    last_put: Dict[bytes, Optional[int]]


@dataclass
class Promise:
    """When a store's handle promised each chunk durable: at the store, or at the engine's next
    settling of the key (``waiting``: key -> how many settlings of it came before the store)."""

    at_store: Moment
    waiting: Dict[bytes, int]


class History:
    """What the tier did, as the engine hears of it (see the module docstring). Event-loop thread."""

    def __init__(self) -> None:
        self.clock = 0  # ticks at every recorded event
        self.last_put: Dict[bytes, int] = {}  # key -> the greatest sequence of a put that landed
        self.removals: Dict[bytes, List[Tuple[int, Optional[int]]]] = {}  # key -> (clock, sequence)
        self.evictions: Dict[bytes, List[int]] = {}  # key -> clocks of its host evictions
        self.resolutions: Dict[bytes, List[Moment]] = {}  # key -> the engine settling its spill
        self.unsure: Set[bytes] = set()  # keys with a put whose outcome the tier never told

    def landed(self, keys: Sequence[bytes], sequence: Any) -> None:
        if not isinstance(sequence, int) or isinstance(sequence, bool):
            return  # a tier without sequences: its puts order nothing
        self.clock += 1
        for key in keys:
            self.last_put[key] = max(sequence, self.last_put.get(key, sequence))

    def unknown(self, keys: Sequence[bytes]) -> None:
        """A put of ``keys`` ended without an answer (cancelled, failed): it may have landed."""
        self.unsure.update(keys)

    def gone(self, key: bytes) -> bool:
        """The history says ``key`` is not readable: a removal at or after its last put."""
        if key in self.unsure:
            return False
        put = self.last_put.get(key)
        return any(sequence is not None and (put is None or sequence >= put)
                   for _, sequence in self.removals.get(key, ()))

    def removed(self, removals) -> None:
        self.clock += 1
        for r in removals:
            if isinstance(r, (bytes, bytearray)):
                self.removals.setdefault(bytes(r), []).append((self.clock, None))
            else:
                self.removals.setdefault(bytes(r.key), []).append((self.clock, r.sequence))

    def host_evicted(self, keys: Sequence[bytes]) -> None:
        self.clock += 1
        for key in keys:
            self.evictions.setdefault(key, []).append(self.clock)

    def now(self, keys: Sequence[bytes]) -> Moment:
        return Moment(self.clock, {k: self.last_put.get(k) for k in keys})

    def resolved(self, key: bytes) -> None:
        """The engine settled ``key``'s spill for the handles waiting for it (durable or not)."""
        self.resolutions.setdefault(key, []).append(self.now([key]))

    def promise(self, waiting: Set[bytes], keys: Sequence[bytes]) -> "Promise":
        """Right after ``store`` returned ``handle``: its chunks found on disk were promised now;
        those it waits for (``waiting``) are promised when the engine next settles their key."""
        return Promise(self.now(keys), {k: len(self.resolutions.get(k, ())) for k in waiting})

    def promised_at(self, key: bytes, promise: "Promise") -> Moment:
        index = promise.waiting.get(key)
        if index is None:
            return promise.at_store
        return self.resolutions[key][index]

    def removed_since(self, key: bytes, moment: Moment) -> bool:
        """A removal of ``key`` reported after ``moment``, of a record newer than its last put then."""
        put = None if key in self.unsure else moment.last_put.get(key)
        return any(
            clock > moment.clock and (sequence is None or put is None or sequence > put)
            for clock, sequence in self.removals.get(key, ())
        )

    def host_evicted_since(self, key: bytes, moment: Moment) -> bool:
        return any(clock > moment.clock for clock in self.evictions.get(key, ()))

    def describe(self, key: bytes, moment: Moment) -> str:
        return (f"promised at clock {moment.clock} with last put {moment.last_put.get(key)}; removals "
                f"(clock, sequence) {self.removals.get(key, [])}; last put now {self.last_put.get(key)}")
