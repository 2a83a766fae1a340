"""Chunk keys on a long prompt: key format v1 (one hash per chunk per group) against v2 (one stream).

Primitives: ``v1_chunk_keys`` (the v1 format, kept verbatim as the baseline), ``measure_keys``
(async; returns a dict of cases), ``main`` (``python -m kvtier.tools.bench.keys``). Runs on the
caller's event loop; everything it times runs on that loop, as an engine's lookup does.

Layout: DeepSeek-V4-like, three groups (FA block 64 x 4 = 256-token chunks; SWA block 64, W 128;
SWA block 8, W 128; R = 3), a 131072-token prompt of random token ids. Cases, before (v1) and after
(v2) in one run, on one ``OffloadEngine`` (host tier only, copies that move no byte):

- ``keys``: token ids -> the keys a lookup needs (v1: every key; v2: a ``KeyChain``, keys on read);
- ``lookup miss``: ``engine.lookup`` on raw token ids of a prompt nothing of which is stored;
- ``lookup hit``: the same after the prompt was stored (the hit covers every token);
- ``grow``: a request growing by one 8-token block per step (decode), per step: the keys alone (the
  newest chunk's key of every group), and keys + ``lookup``. v1 recomputes every key, v2 extends the
  previous step's keys (``RequestKeys.extended``). The lookup is a miss, so it walks every FA chunk.

Each figure is the best of ``repeat`` timed calls in milliseconds (the work is deterministic and the
machine shared: a neighbour only adds time), with the median beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import struct
import sys
import time
from array import array
from typing import Any, Callable, Dict, List, Optional, Sequence, TypedDict

import torch
from blake3 import blake3

from kvtier.engine import EngineConfig, OffloadEngine, RequestKeys
from kvtier.policy import AttentionGroup, ModelLayout

from .engine import NoCopyDeviceView

__all__ = ["v1_chunk_keys", "KeysReport", "measure_keys", "main"]


class KeysReport(TypedDict):
    """What ``measure_keys`` returns (JSON as it is)."""

    tokens: int
    layout: str
    # case -> {"v1": timing, "v2": timing}; "lookup hit" adds "hit_tokens"
    cases: Dict[str, Dict[str, Any]]


def v1_chunk_keys(layout: ModelLayout, token_ids: Sequence[int], *, fingerprint: bytes) -> List[List[bytes]]:
    """Key format v1 as it shipped before v2 (unsalted case): per group, a chain of one BLAKE3 per
    chunk over (parent digest, the chunk's int64 tokens). Kept only as this benchmark's baseline."""

    def part(tag: int, payload: bytes) -> bytes:
        return struct.pack("<BQ", tag, len(payload)) + payload

    tokens = array("q", token_ids)
    if tokens and min(tokens) < 0:
        raise ValueError("token_ids must be non-negative")
    raw = memoryview(tokens).cast("B")
    result: List[List[bytes]] = []
    for group_index, group in enumerate(layout.groups):
        size = group.tokens_per_chunk
        parent = blake3(
            part(1, b"kvtier.chunk-key.v1")
            + part(2, fingerprint)
            + part(3, b"\x00")
            + part(4, struct.pack("<QQQ", group_index, group.block_size, size))
        ).digest()
        keys: List[bytes] = []
        chunk_bytes = size * tokens.itemsize
        for chunk in range(len(tokens) // size):
            hasher = blake3(part(5, parent))
            hasher.update(struct.pack("<BQ", 6, chunk_bytes))
            hasher.update(raw[chunk * chunk_bytes : (chunk + 1) * chunk_bytes])
            parent = hasher.digest()
            keys.append(parent)
        result.append(keys)
    return result


def deepseek_v4_like_layout() -> ModelLayout:
    return ModelLayout(
        (
            AttentionGroup(block_size=64, blocks_per_chunk=4),
            AttentionGroup(block_size=64, sliding_window=128, extra_retained_tokens=3),
            AttentionGroup(block_size=8, sliding_window=128, extra_retained_tokens=3),
        )
    )


def _best_ms(fn: Callable[[], object], repeat: int) -> Dict[str, float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return {"best_ms": round(min(samples), 3), "median_ms": round(statistics.median(samples), 3)}


async def measure_keys(*, tokens: int = 131072, repeat: int = 7, grow_steps: int = 32, seed: int = 0) -> KeysReport:
    """Time the cases of the module docstring; returns {case: {"v1": timing, "v2": timing}}."""
    layout = deepseek_v4_like_layout()
    fingerprint = b"kvtier-bench-keys"
    rng = random.Random(seed)
    prompt = [rng.randrange(150_000) for _ in range(tokens)]
    stored_prompt = [rng.randrange(150_000) for _ in range(tokens)]
    blocks = [-(-(tokens + 8 * grow_steps) // g.block_size) + 1 for g in layout.groups]
    caches = [[torch.zeros(n, 2, g.block_size, 1, 2, dtype=torch.bfloat16)] for n, g in zip(blocks, layout.groups)]
    device = NoCopyDeviceView(layout, caches)
    slot_bytes = sum(device.chunk_nbytes(g) for g in range(len(layout.groups)))
    chunks = sum(tokens // g.tokens_per_chunk for g in layout.groups)
    config = EngineConfig(host_capacity_bytes=2 * chunks * slot_bytes + (1 << 20), store_queue_max_chunks=2 * chunks)
    table = [list(range(1, n)) for n in blocks]

    def v1_request_keys(token_ids: Sequence[int]) -> RequestKeys:
        keys = v1_chunk_keys(layout, token_ids, fingerprint=fingerprint)
        return RequestKeys(tuple(tuple(k) for k in keys), len(token_ids))

    cases: Dict[str, Dict[str, Any]] = {}
    async with OffloadEngine(layout, device, config, fingerprint=fingerprint, pressure_sources={}) as engine:
        cases["keys"] = {
            "v1": _best_ms(lambda: v1_request_keys(prompt), repeat),
            "v2": _best_ms(lambda: engine.request_keys(prompt), repeat),
        }
        cases["lookup miss"] = {
            "v1": _best_ms(lambda: engine.lookup(v1_request_keys(prompt)), repeat),
            "v2": _best_ms(lambda: engine.lookup(prompt), repeat),
        }
        # Store the other prompt under both formats (v1 keys through RequestKeys), then look it up.
        for keys in (v1_request_keys(stored_prompt), engine.request_keys(stored_prompt)):
            handle = engine.store(keys, table)
            await handle.wait_released()
            if handle.dropped:
                raise RuntimeError(f"keys bench: the store dropped chunks ({handle.drop_reason})")
        probe = stored_prompt + [1]
        hits = {"v1": engine.lookup(v1_request_keys(probe)), "v2": engine.lookup(probe)}
        if hits["v1"] != hits["v2"] or not hits["v2"]:
            raise RuntimeError(f"keys bench: v1 and v2 disagree on the hit: {hits}")
        cases["lookup hit"] = {
            "v1": _best_ms(lambda: engine.lookup(v1_request_keys(probe)), repeat),
            "v2": _best_ms(lambda: engine.lookup(probe), repeat),
            "hit_tokens": hits["v2"],
        }
        # Decode: the request grows by one 8-token block per step; each step looks the request up.
        start = tokens - 8 * grow_steps
        steps = [prompt[start + 8 * i : start + 8 * (i + 1)] for i in range(grow_steps)]

        def grow_v1() -> None:
            for i in range(grow_steps):
                engine.lookup(v1_request_keys(prompt[: start + 8 * (i + 1)]))

        base = engine.request_keys(prompt[:start])
        engine.lookup(base)

        def grow_v2() -> None:
            keys = base
            for step in steps:
                keys = keys.extended(step)
                engine.lookup(keys)

        def grow_keys_v1() -> None:
            for i in range(grow_steps):
                v1_request_keys(prompt[: start + 8 * (i + 1)])

        def grow_keys_v2() -> None:
            keys = base
            for step in steps:
                keys = keys.extended(step)
                for group_keys in keys.keys:  # the newest chunk of every group, as a store reads
                    group_keys[len(group_keys) - 1]

        def per_step(v1: Dict[str, float], v2: Dict[str, float]) -> Dict[str, object]:
            return {name: {k: round(v / grow_steps, 4) for k, v in t.items()} for name, t in (("v1", v1), ("v2", v2))}

        fewer = max(1, repeat // 3)
        cases["grow: keys/step"] = per_step(_best_ms(grow_keys_v1, fewer), _best_ms(grow_keys_v2, repeat))
        cases["grow: lookup/step"] = per_step(_best_ms(grow_v1, fewer), _best_ms(grow_v2, repeat))
        await engine.flush()
        engine.check()
    return {"tokens": tokens, "layout": "FA 64x4, SWA 64 W128, SWA 8 W128 (R 3)", "cases": cases}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.bench.keys", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=131072, help="prompt length (default 131072)")
    parser.add_argument("--repeat", type=int, default=7, help="timed calls per case (default 7)")
    parser.add_argument("--grow-steps", type=int, default=32, help="decode steps of 8 tokens (default 32)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.tokens < 8 * (args.grow_steps + 1) or args.repeat < 1 or args.grow_steps < 1:
        parser.error("--tokens must exceed 8 x (--grow-steps + 1); --repeat and --grow-steps >= 1")
    result = asyncio.run(measure_keys(tokens=args.tokens, repeat=args.repeat, grow_steps=args.grow_steps))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"chunk keys on a {result['tokens']}-token prompt, {result['layout']}; best (median) ms")
    print(f"{'case':<18} {'v1 (before)':>20} {'v2 (after)':>20} {'v1/v2':>8}")
    for name, row in result["cases"].items():
        v1, v2 = row["v1"], row["v2"]
        print(
            f"{name:<18} {v1['best_ms']:>9.3f} ({v1['median_ms']:>8.3f}) {v2['best_ms']:>9.3f} ({v2['median_ms']:>8.3f})"
            f" {v1['best_ms'] / max(v2['best_ms'], 1e-9):>7.1f}x"
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
