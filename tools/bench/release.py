"""The host-only release figure alone: ``python -m kvtier.tools.bench.release``.

Primitive: ``main``. The same measurement ``kvtier bench`` reports as "engine store until
released, host tier only" (``_release.measure_engine_release``: paired 256 MiB rounds of the
engine's store until released against the staging copy of the same chunks, the median of the
per-round ratios), without the disk rounds around it, for A/B runs of the store path (seconds, not
minutes, per run). Runs on the calling thread's own event loop; one torch thread, as the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from typing import Optional, Sequence

import torch

from kvtier.tiers.host import HostSlabPool

from ._kv import KVGeometry, make_kv_bytes
from ._release import measure_engine_release
from ._settings import QUICK_ROUNDS, KiB, ROUND_BYTES, label_of

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.bench.release",
                                     description="Engine store until released (host tier only) vs the staging copy.")
    parser.add_argument("--chunk-kib", type=int, default=256, help="chunk size in KiB (default 256)")
    parser.add_argument("--rounds", type=int, default=QUICK_ROUNDS,
                        help=f"paired rounds of 256 MiB (default {QUICK_ROUNDS}, the quick run's)")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    size, rounds = options.chunk_kib * KiB, max(1, options.rounds)
    geometry = KVGeometry.for_chunk(size)
    n = rounds * ROUND_BYTES // size
    view = geometry.device_view(make_kv_bytes(n * size), n)
    with HostSlabPool(size, n) as pool:
        allocation = pool.allocate(n)
        assert allocation is not None, "a fresh pool of n slots has n free"
        slots = [pool.view(s) for s in allocation.slots]
        view.gather_many_groups([(0, geometry.block_ids(c), slot) for c, slot in enumerate(slots)])  # pre-fault
        step = n // rounds
        ranges = [range(r * step, (r + 1) * step) for r in range(rounds)]
        mb_s, per_round = asyncio.run(measure_engine_release(view, geometry, slots, ranges))
    ratio = statistics.median(per_round)
    result = {"chunk": label_of(size), "rounds": rounds, "mb_s": round(mb_s, 1), "ratio_to_staging": round(ratio, 4),
              "per_round": [round(x, 4) for x in per_round], "load_average": os.getloadavg()[0]}
    print(json.dumps(result, sort_keys=True) if options.json else
          f"engine store until released, host tier only {result['chunk']}: {mb_s:.0f} MB/s, {ratio:.2f}x the staging "
          f"copy (median of {rounds} paired rounds; load average {result['load_average']:.1f})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
