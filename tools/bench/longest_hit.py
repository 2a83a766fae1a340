"""Benchmark of the policy's hot functions on a long request.

Times ``longest_hit`` on a 131072-token request over a DeepSeek-V4-like layout of three groups
(FA block 64 x 4 blocks per chunk = 256-token chunks; SWA block 64, W 128; SWA block 8, W 128;
R = 3 on the SWA groups), once with every chunk READY (the full hit) and once with a random 1% of
chunks MISSING, and ``reachable_store_block_mask`` for each group. Prints the median and p90 in
microseconds (``--json`` for one JSON object). Imports only ``kvtier.policy`` and the stdlib.

    python -m kvtier.tools.bench.longest_hit [--repeat N] [--tokens N] [--seed N] [--json]

The target is ``longest_hit`` <= 2 ms on this request (README's benchmark table).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

from kvtier.policy import AttentionGroup, ChunkState, ModelLayout, longest_hit, reachable_store_block_mask

READY = ChunkState.READY
MISSING = ChunkState.MISSING


def deepseek_v4_like_layout(extra_retained_tokens: int = 3) -> ModelLayout:
    return ModelLayout(
        (
            AttentionGroup(block_size=64, blocks_per_chunk=4),
            AttentionGroup(block_size=64, sliding_window=128, extra_retained_tokens=extra_retained_tokens),
            AttentionGroup(block_size=8, sliding_window=128, extra_retained_tokens=extra_retained_tokens),
        )
    )


def time_us(fn: Callable[[], object], repeat: int) -> Dict[str, float]:
    """Median and p90 of ``repeat`` calls, in microseconds (one warm-up call first)."""
    fn()
    samples: List[float] = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000.0)
    samples.sort()
    p90 = samples[min(len(samples) - 1, int(0.9 * len(samples)))]
    return {"median_us": round(statistics.median(samples), 2), "p90_us": round(p90, 2), "repeat": repeat}


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per case (default 200)")
    parser.add_argument("--tokens", type=int, default=131072, help="request length in tokens (default 131072)")
    parser.add_argument("--missing-fraction", type=float, default=0.01, help="chunks MISSING in the second case")
    parser.add_argument("--seed", type=int, default=0, help="seed of the MISSING chunk choice")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.tokens < 1 or not 0.0 <= args.missing_fraction <= 1.0:
        parser.error("--repeat and --tokens must be positive, --missing-fraction in [0, 1]")

    layout = deepseek_v4_like_layout()
    num_tokens = args.tokens
    rng = random.Random(args.seed)
    # One state table per group, as an engine keeps them: index -> state, read by a plain function.
    all_ready = [[READY] * (num_tokens // g.tokens_per_chunk + 2) for g in layout.groups]
    with_missing = []
    for table in all_ready:
        table = list(table)
        for chunk in rng.sample(range(len(table)), round(args.missing_fraction * len(table))):
            table[chunk] = MISSING
        with_missing.append(table)

    def state_fn(tables):
        def state(group_index: int, chunk_index: int) -> ChunkState:
            table = tables[group_index]
            return table[chunk_index] if chunk_index < len(table) else MISSING

        return state

    ready_state, missing_state = state_fn(all_ready), state_fn(with_missing)
    results: Dict[str, object] = {
        "tokens": num_tokens,
        "layout": [
            {
                "block_size": g.block_size,
                "blocks_per_chunk": g.blocks_per_chunk,
                "sliding_window": g.sliding_window,
                "extra_retained_tokens": g.extra_retained_tokens,
            }
            for g in layout.groups
        ],
        "python": sys.version.split()[0],
    }
    cases = {}
    hit = longest_hit(layout, num_tokens, ready_state)
    cases["longest_hit all READY"] = dict(time_us(lambda: longest_hit(layout, num_tokens, ready_state), args.repeat), hit=hit)
    hit = longest_hit(layout, num_tokens, missing_state)
    cases[f"longest_hit {args.missing_fraction:.0%} MISSING"] = dict(
        time_us(lambda: longest_hit(layout, num_tokens, missing_state), args.repeat), hit=hit
    )
    for gi, g in enumerate(layout.groups):
        kind = "FA" if g.sliding_window is None else f"SWA b{g.block_size} W{g.sliding_window}"
        mask = reachable_store_block_mask(layout, gi, num_tokens)

        def group_mask(gi: int = gi) -> object:
            return reachable_store_block_mask(layout, gi, num_tokens)

        cases[f"store mask group {gi} ({kind})"] = dict(
            time_us(group_mask, args.repeat),
            blocks=len(mask),
            stored=sum(mask),
        )
    results["cases"] = cases

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"kvtier.policy on a {num_tokens}-token request, 3 groups, python {results['python']}")
    print(f"{'case':<36} {'median us':>10} {'p90 us':>10}  result")
    for name, row in cases.items():
        extra = f"hit={row['hit']}" if "hit" in row else f"{row['stored']}/{row['blocks']} blocks stored"
        print(f"{name:<36} {row['median_us']:>10.1f} {row['p90_us']:>10.1f}  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
