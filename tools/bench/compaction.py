"""What segment compaction costs and gives back: ``python -m kvtier.tools.bench.compaction``.

One run: fill an LMDB tier with segments on (raw codec, ``--record-kib`` records, ``--segment-mib``
segments, automatic compaction off while filling), delete records at random until about
``--live-fraction`` of them is left, reopen, and time ``compact_segments``. Reported beside
baselines of the same run: the tier's own durable put of the same bytes (what one move costs at
most: read + write + commit), and single-record put latency measured alone and while the pass runs
(compaction steps share the writer thread with puts). Every moved record is read back and checked.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import List

from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.lmdb.compaction import segment_disk_bytes
from kvtier.tiers.record_format import CodecConfig
from kvtier.tools.testing.children import chunk_content, make_batch

__all__ = ["main"]

_MiB = 1 << 20


async def _put_latencies(tier: LmdbTier, seed: int, count: int, record: int) -> List[float]:
    out = []
    for i in range(count):
        items = make_batch(seed, i, [record])
        t = time.perf_counter()
        await tier.put_many(items)
        out.append(time.perf_counter() - t)
    return out


async def _run(args: argparse.Namespace, root: Path) -> None:
    record = args.record_kib << 10
    count = args.total_mib * _MiB // record
    options = dict(segment_threshold_bytes=64 << 10, segment_max_bytes=args.segment_mib * _MiB,
                   codec=CodecConfig(compress=False), map_size_bytes=64 * _MiB)
    path = root / "cache"
    rng = random.Random(args.seed)
    batches = [make_batch(args.seed, b, [record] * 16) for b in range(count // 16)]
    async with await LmdbTier.open(path, segment_compaction_live_fraction=0, **options) as tier:
        t = time.perf_counter()
        for batch in batches:
            await tier.put_many(batch)
        put_s = time.perf_counter() - t
        keys = [k for b in batches for k, _, _ in b]
        doomed = rng.sample(keys, int(len(keys) * (1 - args.live_fraction)))
        await tier.delete_many(doomed)
    live = [it for b in batches for it in b if it[0] not in set(doomed)]
    before = segment_disk_bytes(path)
    async with await LmdbTier.open(path, **options) as tier:
        alone = await _put_latencies(tier, args.seed + 1, args.latency_puts, record)
        pass_task = asyncio.ensure_future(tier.compact_segments())
        t = time.perf_counter()
        during: List[float] = []
        while not pass_task.done() and len(during) < 10 * args.latency_puts:
            during += await _put_latencies(tier, args.seed + 2 + len(during), 1, record)
        report = await pass_task
        compact_s = time.perf_counter() - t
        after = segment_disk_bytes(path)
        bufs = [bytearray(record) for _ in live]
        metas = await tier.get_many_into([(it[0], memoryview(b)) for it, b in zip(live, bufs)])
        bad = sum(1 for m, b, it in zip(metas, bufs, live) if m is None or bytes(b) != chunk_content(it[0]))
        problems = await tier.check()
    put_mbs = count * record / put_s / 1e6
    move_mbs = report.bytes / compact_s / 1e6 if compact_s else 0.0
    print(f"{args.total_mib} MiB of {args.record_kib} KiB records in {args.segment_mib} MiB segments, "
          f"{len(live)} of {count} left live ({len(live) / count:.0%})")
    latency_bytes = (len(alone) + len(during)) * (record + 4096)  # a record's extent: head page + payload
    print(f"segment files on disk: {before} -> {after} bytes ({after / before:.2f}x; "
          f"{after - latency_bytes} without the latency puts' records); "
          f"{report.records} records ({report.bytes} bytes) moved out of {report.segments} segments, "
          f"{report.files_freed} files deleted")
    print(f"compaction {move_mbs:.0f} MB/s moved vs the tier's durable put {put_mbs:.0f} MB/s "
          f"(same run): {move_mbs / put_mbs:.2f}x")
    if during:
        print(f"single-record put latency alone p50 {statistics.median(alone) * 1e3:.1f} ms max "
              f"{max(alone) * 1e3:.1f} ms; during the pass p50 {statistics.median(during) * 1e3:.1f} ms max "
              f"{max(during) * 1e3:.1f} ms ({len(during)} puts)")
    print(f"read back: {len(live) - bad} of {len(live)} live records bitwise; check(): {problems or 'clean'}")


def main(argv: "List[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.bench.compaction", description=__doc__)
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--record-kib", type=int, default=1024)
    parser.add_argument("--segment-mib", type=int, default=32)
    parser.add_argument("--live-fraction", type=float, default=0.3)
    parser.add_argument("--latency-puts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where to put the cache (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-compaction-", dir=args.dir))
    try:
        asyncio.run(_run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
