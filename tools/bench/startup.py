"""How long ``OffloadEngine.start`` takes before the engine answers, at 10^4, 10^5 (and 10^6) chunks
on disk (also after a writer was killed -9), and with a large host pool.

    python -m kvtier.tools.bench.startup [--dir DIR] [--million] [--rounds 3] [--record-bytes 64]
                                         [--pool-gib 2]

Per cache size a cache directory of that many small records (``--record-bytes`` each, so 10^6 fit
in ~0.55 GB) is built once under ``--dir`` and reused by later runs. Each round starts an engine over
it (a 4 MiB host pool, 256 KiB chunks) with the structure check (``lmdb_verify_on_open``, the
default) walking the file (the first start after a writer that did not verify, and the first after
a writer killed -9 that had just put a record: one round each), on a
file stamped by a verified clean close (the usual restart), and off, and reports (the median of
the rounds): ``start`` (``await engine.start()``), ``first lookup`` (start to the
first ``lookup`` answered), ``indexed`` (start to the end of the listing of every key:
``engine.flush()`` then ``len(engine.disk_index)``), and the longest event-loop gap from start to
indexed (a task sleeping 1 ms at a time; the 1 ms included). The page cache is warm (the cache
was just built or used). A last row starts an engine with no disk and a ``--pool-gib`` host pool:
start, first lookup, the longest loop gap until the pool is made, and when it is (``pools``).
A benchmark script, not a test: it asserts only that every key got indexed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.lmdb.recovery import VERIFIED_STAMP
from kvtier.tools.testing.scenario import make_cpu_device

LAYOUT = ModelLayout(groups=(AttentionGroup(16),))
_BUILD_BATCH = 20000
_GiB = 1 << 30


async def build_cache(path: Path, count: int, record_bytes: int) -> None:
    """``count`` records of ``record_bytes`` under ``path``, unless a finished build is there."""
    done = path / "built"
    if done.exists() and done.read_text() == f"{count} {record_bytes}":
        return
    tier = await LmdbTier.open(path, segment_threshold_bytes=None, map_size_bytes=_GiB)
    try:
        meta = ChunkMeta(b"kvtier-bench-startup", 0, 0, "uint8", (record_bytes,))
        payload = memoryview(bytes(record_bytes))
        for first in range(0, count, _BUILD_BATCH):
            await tier.put_many([(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest(), meta, payload)
                                 for i in range(first, min(count, first + _BUILD_BATCH))])
    finally:
        await tier.close()
    done.write_text(f"{count} {record_bytes}")


class LoopGaps:
    """The longest wait of a 1 ms sleep on the running loop, while running."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self._task: Optional[asyncio.Task] = None

    def __enter__(self) -> "LoopGaps":
        self._task = asyncio.ensure_future(self._watch())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.longest_s = max(self.longest_s, time.perf_counter() - before)


# A writer killed -9 after one put (it rewrites the cache's first record, so the count stays): the
# file changed since the verified clean close and is never stamped again (what a crash, an OOM kill
# or a power cut leaves).
_KILLED_WRITER = """
import asyncio, hashlib, sys
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier
async def main():
    tier = await LmdbTier.open(sys.argv[1], segment_threshold_bytes=None, map_size_bytes=1 << 30,
                               index_in_background=True)
    size = int(sys.argv[2])
    meta = ChunkMeta(b"kvtier-bench-startup", 0, 0, "uint8", (size,))
    key = hashlib.blake2b((0).to_bytes(8, "little"), digest_size=32).digest()
    await tier.put_many([(key, meta, memoryview(bytes(size)))])
    print("put", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def kill_a_writer(path: Path, record_bytes: int) -> None:
    """Run a writer on ``path`` that rewrites one record of ``build_cache``'s, and SIGKILL it once
    its put returned (durable)."""
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), str(record_bytes)],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.strip() != b"put":
            raise RuntimeError(f"the writer to kill said {line!r}")
    finally:
        child.kill()
        child.wait()


async def one_start(config: EngineConfig, expect_keys: int) -> Dict[str, float]:
    """One engine start over ``config``: seconds to start, to the first lookup, to indexed (and
    to the pools made), and the longest loop gap."""
    # 256 KiB chunks (2 layers x K and V x 16 tokens x 8 heads x 128 x fp32), as a serving model's
    device = make_cpu_device(LAYOUT, num_blocks=16, num_layers=2, kv_heads=8, head_dim=128)
    engine = OffloadEngine(LAYOUT, device, config, fingerprint=b"bench-startup")
    prompt = list(range(33))
    with LoopGaps() as gaps:
        began = time.perf_counter()
        await engine.start()
        started = time.perf_counter()
        engine.lookup(prompt)
        first = time.perf_counter()
        await engine.flush()
        indexed = time.perf_counter()
    try:
        if len(engine.disk_index) != expect_keys:
            raise RuntimeError(f"{len(engine.disk_index)} keys indexed, {expect_keys} on disk")
    finally:
        await engine.close()
    return {"start_s": started - began, "first_lookup_s": first - began, "indexed_s": indexed - began,
            "longest_gap_s": gaps.longest_s}


def _median(rows: List[Dict[str, float]]) -> Dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


async def run(where: Path, sizes: List[int], rounds: int, record_bytes: int, pool_gib: float) -> List[Dict]:
    results: List[Dict] = []
    for count in sizes:
        path = where / f"startup-{count}"
        await build_cache(path, count, record_bytes)
        for verify in (True, False):
            config = EngineConfig(cache_dir=str(path), host_capacity_bytes=4 << 20, lmdb_verify_on_open=verify,
                                  pressure_poll_interval_s=3600.0)
            if verify:  # the first start after a writer that did not verify walks the whole file
                (path / VERIFIED_STAMP).unlink(missing_ok=True)
                results.append({"chunks": count, "verify": "walk", **await one_start(config, count)})
                # and so does the first after a writer killed -9 (a real one: its put changed the file)
                kill_a_writer(path, record_bytes)
                results.append({"chunks": count, "verify": "killed", **await one_start(config, count)})
            rows = [await one_start(config, count) for _ in range(rounds)]
            results.append({"chunks": count, "verify": "stamped" if verify else "off", **_median(rows)})
    if pool_gib > 0:
        config = EngineConfig(host_capacity_bytes=int(pool_gib * _GiB), pressure_poll_interval_s=3600.0)
        rows = [await one_start(config, 0) for _ in range(rounds)]
        results.append({"chunks": 0, "verify": None, "pool_gib": pool_gib, **_median(rows)})
    return results


def format_results(results: List[Dict]) -> str:
    lines = [f"{'cache':>30} {'start':>8} {'1st lookup':>11} {'indexed':>9} {'longest loop gap':>17}"]
    for r in results:
        if r["verify"] is None:
            what = f"no disk, {r['pool_gib']:g} GiB pool"
            done = "pools"
        else:
            what = f"{r['chunks']:,} chunks, verify {r['verify']}"
            done = ""
        lines.append(f"{what:>30} {r['start_s']:>7.3f}s {r['first_lookup_s']:>10.3f}s {r['indexed_s']:>8.3f}s "
                     f"{r['longest_gap_s'] * 1000:>15.1f}ms {done}".rstrip())
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the caches are built and kept (default: the temp dir)")
    parser.add_argument("--million", action="store_true", help="also 10^6 chunks (~0.55 GB, built once)")
    parser.add_argument("--sizes", default="10000,100000", help="chunk counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--record-bytes", type=int, default=64)
    parser.add_argument("--pool-gib", type=float, default=2.0, help="host pool of the no-disk row (0: no row)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.million:
        sizes.append(1_000_000)
    where = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "kvtier-bench-startup"
    where.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run(where, sizes, args.rounds, args.record_bytes, args.pool_gib))
    print(format_results(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
