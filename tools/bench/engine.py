"""Engine bookkeeping cost per chunk: store + lookup + load, excluding copies and I/O.

Primitives: ``measure_bookkeeping`` (async; returns a ``BookkeepingResult``), ``NoCopyDeviceView``
(a ``DeviceKVView`` whose copies do nothing), ``main`` (``python -m kvtier.tools.bench.engine``).
Runs on the caller's event loop; the engine's copy threads still run (one hop per batch).

Method. An ``OffloadEngine`` with no disk tier (no spill, no I/O) drives a device view whose
``gather_many_groups`` / ``scatter_many_groups`` return an already-done handle without touching a
byte, so what is left is exactly the engine's own work per chunk: keys already computed (their
BLAKE3 cost is reported apart), planning (``store_chunk_indices`` / ``load_block_plan``), chunk
entries and states, host-slot allocation, pins, owner tags, eviction-policy updates, fences, the
metrics, ``longest_hit`` over the engine's state table, and the one executor hop per batch that the
engine pays to run a copy off the loop (part of its overhead, amortised over the batch's chunks).

Each round stores ``requests`` fresh requests of ``chunks_per_request`` chunks one after another
(``store`` then ``wait_released``), looks each up with one more token, and loads each hit into other
device blocks (``load`` is awaited one request at a time). The per-chunk figure is the round's wall
time of each phase divided by the chunks that phase handled; the reported value is the best round
(the work is deterministic and the machines are shared: a neighbour only ever adds time, so the
fastest round is the closest to the engine's own cost; ``median_total_us_per_chunk`` says how far
the typical round was from it). ``with_copies=True`` swaps in the real device view over
tiny chunks (a few hundred bytes), which adds the view's validation and copy-call overhead: the
difference between the two is what the device view costs per chunk, not the engine.

The default layout is full attention only (every chunk is stored once and loaded once, so
"per chunk" has one meaning); ``hybrid=True`` adds a sliding-window group with MTP R = 3, where
stores and loads touch different chunk counts (each phase is divided by its own count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.device_backend import CopyHandle

__all__ = ["BookkeepingResult", "NoCopyDeviceView", "measure_bookkeeping", "main"]


class NoCopyDeviceView(DeviceKVView):
    """A device view whose batch copies are no-ops: the engine's bookkeeping runs unchanged, no
    byte moves. For measuring only; never hand it to a real engine."""

    def gather_many_groups(self, items, *, compute_stream=None, ready_event=None, wait: bool = True) -> CopyHandle:
        return CopyHandle(self.backend, None)

    def scatter_many_groups(self, items, *, compute_stream=None, ready_event=None, wait: bool = True) -> CopyHandle:
        return CopyHandle(self.backend, None)


@dataclass
class BookkeepingResult:
    """Per-chunk costs in microseconds of the best round (and the settings that produced them)."""

    total_us_per_chunk: float
    store_us_per_chunk: float
    lookup_us_per_chunk: float
    load_us_per_chunk: float
    keys_us_per_chunk: float
    median_total_us_per_chunk: float
    chunks_per_request: int
    requests_per_round: int
    rounds: int
    hybrid: bool
    with_copies: bool

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


def _layout(hybrid: bool) -> ModelLayout:
    full = AttentionGroup(16, blocks_per_chunk=4)
    if not hybrid:
        return ModelLayout(groups=(full,))
    return ModelLayout(groups=(full, AttentionGroup(16, sliding_window=128, extra_retained_tokens=3)))


async def measure_bookkeeping(
    *,
    chunks_per_request: int = 256,
    requests: int = 8,
    rounds: int = 5,
    hybrid: bool = False,
    with_copies: bool = False,
    seed: int = 0,
    eviction_policy: Optional[str] = None,
) -> BookkeepingResult:
    """Measure the engine's per-chunk cost of store + lookup + load (see the module docstring)."""
    if chunks_per_request < 1 or requests < 1 or rounds < 1:
        raise ValueError("chunks_per_request, requests and rounds must be >= 1")
    layout = _layout(hybrid)
    tokens_per_request = chunks_per_request * layout.groups[0].tokens_per_chunk
    blocks_per_request = [-(-tokens_per_request // g.block_size) for g in layout.groups]
    # Two tables per request (producer, consumer), block 0 kept as a null block.
    num_blocks = 2 * requests * max(blocks_per_request) + 1
    caches = [
        [torch.zeros(num_blocks, 2, g.block_size, 1, 2, dtype=torch.bfloat16)] for g in layout.groups
    ]
    view_cls = DeviceKVView if with_copies else NoCopyDeviceView
    device = view_cls(layout, caches)
    chunk_slots = sum(-(-tokens_per_request // g.tokens_per_chunk) for g in layout.groups)
    slot_bytes = sum(device.chunk_nbytes(g) for g in range(len(layout.groups)))
    config = EngineConfig(
        # Room for every round's chunks: stores always find free slots, nothing is evicted.
        host_capacity_bytes=(rounds + 1) * requests * chunk_slots * slot_bytes,
        store_queue_max_chunks=max(4096, requests * chunk_slots),
    )
    if eviction_policy is not None:
        config = replace(config, eviction_policy=eviction_policy, host_eviction_policy=None)  # the name on both tiers
    rng = random.Random(seed)
    samples: Dict[str, List[float]] = {"store": [], "lookup": [], "load": [], "keys": []}

    def tables(first_block: int) -> List[List[int]]:
        return [list(range(first_block, first_block + n)) for n in blocks_per_request]

    async with OffloadEngine(layout, device, config, fingerprint=b"kvtier-bench-engine", pressure_sources={}) as engine:
        for _ in range(rounds + 1):  # the first round warms caches and the copy threads; dropped
            prompts = [[rng.randrange(32000) for _ in range(tokens_per_request)] for _ in range(requests)]
            # Keys are hashed when first read (``RequestKeys`` is lazy): read them all here, or the
            # store and lookup phases below would time BLAKE3 instead of the engine's bookkeeping.
            started = time.perf_counter()
            producer_keys = [engine.request_keys(p) for p in prompts]
            consumer_keys = [engine.request_keys(p + [1]) for p in prompts]
            hashed = sum(len(group[:]) for request in producer_keys + consumer_keys for group in request.keys)
            keys_s = time.perf_counter() - started
            producer_tables = [tables(1 + 2 * r * max(blocks_per_request)) for r in range(requests)]
            consumer_tables = [tables(1 + (2 * r + 1) * max(blocks_per_request)) for r in range(requests)]

            stored = 0
            started = time.perf_counter()
            for keys, table in zip(producer_keys, producer_tables):
                handle = engine.store(keys, table)
                await handle.wait_released()
                stored += len(handle.scheduled)
            store_s = time.perf_counter() - started

            started = time.perf_counter()
            hits = [engine.lookup(keys) for keys in consumer_keys]
            lookup_s = time.perf_counter() - started

            loaded_chunks = 0
            started = time.perf_counter()
            for keys, hit, table in zip(consumer_keys, hits, consumer_tables):
                if hit is None:  # load needs a hit length; None says chunks are still in flight
                    raise RuntimeError("bookkeeping bench: a lookup found chunks still in flight")
                result = await engine.load(keys, hit, table)
                if not result.ok:
                    raise RuntimeError(f"bookkeeping bench: load failed ({result.reason})")
                loaded_chunks += result.chunks_from_host + result.chunks_from_disk
            load_s = time.perf_counter() - started
            if stored == 0 or loaded_chunks == 0:
                raise RuntimeError("bookkeeping bench: nothing stored or loaded")

            samples["store"].append(store_s / stored)
            samples["lookup"].append(lookup_s / loaded_chunks)
            samples["load"].append(load_s / loaded_chunks)
            samples["keys"].append(keys_s / hashed)
        await engine.flush()
        engine.check()

    totals = [st + lk + ld for st, lk, ld in zip(samples["store"][1:], samples["lookup"][1:], samples["load"][1:])]
    best = min(range(len(totals)), key=totals.__getitem__) + 1  # the warm-up round is index 0
    return BookkeepingResult(
        total_us_per_chunk=totals[best - 1] * 1e6,
        store_us_per_chunk=samples["store"][best] * 1e6,
        lookup_us_per_chunk=samples["lookup"][best] * 1e6,
        load_us_per_chunk=samples["load"][best] * 1e6,
        keys_us_per_chunk=min(samples["keys"][1:]) * 1e6,
        median_total_us_per_chunk=statistics.median(totals) * 1e6,
        chunks_per_request=chunks_per_request,
        requests_per_round=requests,
        rounds=rounds,
        hybrid=hybrid,
        with_copies=with_copies,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.tools.bench.engine",
        description="Engine bookkeeping cost per chunk (store + lookup + load, no copies, no I/O).",
    )
    parser.add_argument("--chunks-per-request", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hybrid", action="store_true", help="add a sliding-window group (W 128, R 3)")
    parser.add_argument("--with-copies", action="store_true", help="real device view over tiny chunks")
    parser.add_argument("--eviction-policy", help="EngineConfig.eviction_policy (default: EngineConfig's)")
    parser.add_argument("--json", action="store_true")
    options = vars(parser.parse_args(argv))
    as_json = options.pop("json")
    # Every other option is one of measure_bookkeeping's keywords, under the same name.
    result = asyncio.run(measure_bookkeeping(**options))
    if as_json:
        print(json.dumps(result.to_dict(), sort_keys=True))
    else:
        print(
            f"engine bookkeeping: {result.total_us_per_chunk:.1f} us/chunk "
            f"(store {result.store_us_per_chunk:.1f}, lookup {result.lookup_us_per_chunk:.1f}, "
            f"load {result.load_us_per_chunk:.1f}; keys {result.keys_us_per_chunk:.1f} us/chunk apart) "
            f"over {result.requests_per_round} requests x {result.chunks_per_request} chunks, "
            f"best of {result.rounds} rounds (median {result.median_total_us_per_chunk:.1f})"
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
