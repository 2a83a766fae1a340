"""What LMDB's ``metasync=True`` costs the spill path: paired rounds, same machine, same run.

    python -m kvtier.tools.bench.metasync [--rounds 8] [--batches 16] [--chunks 16] [--chunk-kib 256]

Each round writes ``batches`` spill batches (``chunks`` incompressible chunks each, raw codec, one
``put_many`` per batch, as the engine's spill does) into a fresh ``LmdbTier`` twice: once as the
tier opens it (``metasync=True``: the meta page is flushed with each commit, so a commit that
returned survives a power cut) and once with ``metasync=False`` forced (LMDB may then lose the last
commit on a system crash). The order alternates per round so drift of a shared machine hits both.
Prints the median MB/s of each and their ratio. A benchmark script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import lmdb

from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig

_REAL_OPEN = lmdb.open


def _open_with(metasync: bool):
    def open_env(*args, **kwargs):
        kwargs["metasync"] = metasync
        return _REAL_OPEN(*args, **kwargs)

    return open_env


async def _one(directory: Path, metasync: bool, batches: List[list]) -> float:
    lmdb.open = _open_with(metasync)
    try:
        # every record inline: the cost measured is that of LMDB's own commits
        tier = await LmdbTier.open(directory, codec=CodecConfig(compress=False), map_size_bytes=1 << 30,
                                   segment_threshold_bytes=None)
    finally:
        lmdb.open = _REAL_OPEN
    try:
        started = time.perf_counter()
        for batch in batches:
            await tier.put_many(batch)
        elapsed = time.perf_counter() - started
    finally:
        await tier.close()
    return elapsed


async def run(rounds: int, n_batches: int, chunks: int, chunk_kib: int, where: str) -> Dict[str, float]:
    size = chunk_kib * 1024
    meta = ChunkMeta(b"kvtier-bench-metasync", 0, 0, "uint8", (size,))
    total_mb = n_batches * chunks * size / 1e6
    speeds: Dict[bool, List[float]] = {True: [], False: []}
    for r in range(rounds):
        payload = [memoryview(bytearray(os.urandom(size))) for _ in range(chunks)]
        batches = [[(os.urandom(32), meta, payload[i]) for i in range(chunks)] for _ in range(n_batches)]
        for metasync in ((True, False) if r % 2 == 0 else (False, True)):
            directory = Path(tempfile.mkdtemp(prefix="kvtier-metasync-", dir=where))
            try:
                speeds[metasync].append(total_mb / await _one(directory / "lmdb", metasync, batches))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
    return {"metasync_on_mb_s": on, "metasync_off_mb_s": off, "ratio_on_vs_off": on / off}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--dir", default=None, help="filesystem to measure (default: the temp dir)")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.rounds, args.batches, args.chunks, args.chunk_kib, args.dir))
    print(f"spill {args.batches} x {args.chunks} x {args.chunk_kib} KiB, median of {args.rounds} paired rounds: "
          f"metasync on {result['metasync_on_mb_s']:.0f} MB/s, off {result['metasync_off_mb_s']:.0f} MB/s, "
          f"ratio on/off {result['ratio_on_vs_off']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
