"""Store until released without a disk tier: the engine's own cost of freeing device blocks.

Primitive: ``measure_engine_release`` (async; MB/s). The target is the engine's store until
released at >= 0.8x the bare staging copy. In the end-to-end figure (``EngineSubject``) the
spill of the first requests (zstd encoding on the tier's read pool, LMDB writes) runs while later
requests are still being copied, and on 2 cores it takes CPU from the copy thread: that figure
measures the machine's contention, not the store path (on a GPU server the copy is a DMA on its
own stream). This one stores the same requests into an engine with a host tier only, so nothing
else competes, and is reported beside the bare staging copy of the same run.
"""

from __future__ import annotations

import asyncio
import random
import time

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.tiers.device import DeviceKVView

from ._kv import KVGeometry
from ._settings import BATCH_BYTES, mb_s

__all__ = ["measure_engine_release"]


async def measure_engine_release(view: DeviceKVView, geometry: KVGeometry, num_chunks: int, *, repeats: int = 2,
                                 seed: int = 0) -> float:
    """MB/s of ``store`` + ``wait_released`` of ``num_chunks`` chunks (requests of up to 64 MiB, all
    scheduled at once, as ``EngineSubject`` stores a round) into a host-only engine; best of
    ``repeats`` fresh engines."""
    per_request = max(1, BATCH_BYTES // geometry.chunk_bytes)
    rng = random.Random(seed)
    best = 0.0
    for _ in range(repeats):
        config = EngineConfig(host_capacity_bytes=num_chunks * geometry.chunk_bytes,
                              store_queue_max_chunks=max(4096, num_chunks))
        async with OffloadEngine(geometry.layout, view, config, fingerprint=b"kvtier-bench-release",
                                 pressure_sources={}) as engine:
            requests = []
            for first in range(0, num_chunks, per_request):
                last = min(first + per_request, num_chunks)
                tokens = [rng.randrange(1, 32000) for _ in range((last - first) * geometry.tokens_per_chunk)]
                table = [[b for c in range(first, last) for b in geometry.block_ids(c)]]
                requests.append((engine.request_keys(tokens), table))
            started = time.perf_counter()
            handles = [engine.store(keys, table) for keys, table in requests]
            await asyncio.gather(*(h.wait_released() for h in handles))
            elapsed = time.perf_counter() - started
            if any(h.dropped for h in handles):
                raise RuntimeError("release bench: the host-only engine dropped chunks")
            best = max(best, mb_s(num_chunks * geometry.chunk_bytes, elapsed))
    return best
