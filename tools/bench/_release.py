"""Store until released without a disk tier: the engine's own cost of freeing device blocks.

Primitive: ``measure_engine_release`` (async; MB/s and the paired ratio). The target is the
engine's store until released at >= 0.8x the bare staging copy. In the end-to-end figure
(``EngineSubject``) the spill of the first requests (zstd encoding on the tier's read pool, LMDB
writes) runs while later requests are still being copied, and on 2 cores it takes CPU from the
copy thread: that figure measures the machine's contention, not the store path (on a GPU server
the copy is a DMA on its own stream). This one stores the same requests into an engine with a host
tier only, so nothing else competes.

Paired rounds, as the disk figures: round after round the same chunks are staged (the bare
``gather_many_groups`` into the bench's slots) right before and right after they are stored by a
fresh host-only engine, the faster staging copy the round's baseline; the ratio is the median over
rounds of the engine's speed over the staging copy's. A round is the run's round (``ROUND_BYTES``: what ``EngineSubject``
stores at once), so the quick run measures the same rounds as the full run, fewer of them.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import List, Sequence, Tuple

import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.tiers.device import DeviceKVView

from ._kv import KVGeometry
from ._settings import BATCH_BYTES, mb_s

__all__ = ["measure_engine_release"]


async def _store_round(view: DeviceKVView, geometry: KVGeometry, chunks: range, rng: random.Random) -> float:
    """Seconds of ``store`` + ``wait_released`` of ``chunks`` (requests of up to 64 MiB, all
    scheduled at once, as ``EngineSubject`` stores a round) into a fresh host-only engine."""
    per_request = max(1, BATCH_BYTES // geometry.chunk_bytes)
    config = EngineConfig(host_capacity_bytes=len(chunks) * geometry.chunk_bytes,
                          store_queue_max_chunks=max(4096, len(chunks)))
    async with OffloadEngine(geometry.layout, view, config, fingerprint=b"kvtier-bench-release",
                             pressure_sources={}) as engine:
        requests = []
        for first in range(chunks.start, chunks.stop, per_request):
            last = min(first + per_request, chunks.stop)
            tokens = [rng.randrange(1, 32000) for _ in range((last - first) * geometry.tokens_per_chunk)]
            table = [[b for c in range(first, last) for b in geometry.block_ids(c)]]
            keys = engine.request_keys(tokens)
            _ = [group[:] for group in keys.keys]  # hashed now: the caller's cost (as in the bookkeeping bench)
            requests.append((keys, table))
        started = time.perf_counter()
        handles = [engine.store(keys, table) for keys, table in requests]
        await asyncio.gather(*(h.wait_released() for h in handles))
        elapsed = time.perf_counter() - started
        if any(h.dropped for h in handles):
            raise RuntimeError("release bench: the host-only engine dropped chunks")
    return elapsed


def _stage_round(view: DeviceKVView, geometry: KVGeometry, slots: Sequence[torch.Tensor], chunks: range) -> float:
    """Seconds of the bare staging copy of ``chunks`` into ``slots``, 64 MiB per call."""
    per_call = max(1, BATCH_BYTES // geometry.chunk_bytes)
    items = [(0, geometry.block_ids(c), slots[c]) for c in chunks]
    started = time.perf_counter()
    for i in range(0, len(items), per_call):
        view.gather_many_groups(items[i : i + per_call])
    return time.perf_counter() - started


async def measure_engine_release(view: DeviceKVView, geometry: KVGeometry, slots: Sequence[torch.Tensor],
                                 rounds: Sequence[range], *, seed: int = 0) -> Tuple[float, List[float]]:
    """(MB/s of the engine's store until released over every round, per round its speed over the
    staging copy's of the same chunks in that round: the figure is their median); module docstring."""
    rng = random.Random(seed)
    engine_s: List[float] = []
    ratios: List[float] = []
    for chunks in rounds:
        # The staging copy runs right before and right after the store, and the faster of the two
        # is the round's baseline: one copy stalled by the machine (the kernel writing back the
        # disk rounds' pages) must not make the engine look faster than the copy it makes.
        before = _stage_round(view, geometry, slots, chunks)
        stored = await _store_round(view, geometry, chunks, rng)
        staged = min(before, _stage_round(view, geometry, slots, chunks))
        engine_s.append(stored)
        ratios.append(staged / stored)
    nbytes = sum(len(r) for r in rounds) * geometry.chunk_bytes
    return mb_s(nbytes, sum(engine_s)), ratios
