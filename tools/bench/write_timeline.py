"""Where a round of durable writes spends its time: ``python -m kvtier.tools.bench.write_timeline``.

Primitives: ``WriteTimeline`` (the I/O calls of one round, as intervals), ``record_io`` (a context
manager that times the LMDB tier's segment writes, syncs, block allocations and write
transactions while it is open), ``main``.

The paired rounds of ``kvtier bench`` give ratios whose noise on a shared virtual disk is larger
than most changes to the write path (two full runs of the same code differ by more than 15% in
half the rows). This probe measures what the write path controls, whatever the disk's speed that
minute: the put batches of a round (64 MiB each, as the engine's spill puts them, all in flight
as the spill keeps them) go to one open ``LmdbTier``, and each round reports the milliseconds
before its first direct write (the encode, staging), the milliseconds after its last (the sync and
the commits), the share of the round with at least one and at least two direct writes in flight
(the disk's queue: this disk is saturated by two), and the time the writer spent in ``fallocate``
calls that waited for writes in flight (ext4 waits for every direct write to the file first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.host import HostSlabPool
from kvtier.tiers.lmdb import LmdbTier, segments
from kvtier.tiers.lmdb.writes import WriterSide
from kvtier.tiers.record_format import CodecConfig

from ._busy import BUSY_KINDS, busy
from ._kv import make_kv_bytes
from ._settings import BATCH_BYTES, BATCH_MAX_CHUNKS, MiB, SPILL_BATCHES_IN_FLIGHT, label_of, mb_s

__all__ = ["WriteTimeline", "record_io", "main"]

# An allocation that took longer than this waited for the writes in flight (one that did not
# returns in well under a millisecond here).
STALL_S = 0.001


@dataclass
class WriteTimeline:
    """The I/O calls of one round as (start, end) seconds from its start, by kind: ``write``
    (direct writes, with their bytes), ``sync`` (``fdatasync`` of a segment), ``allocate``
    (``fallocate``), ``commit`` (an LMDB write transaction, its syncs included)."""

    started: float = field(default_factory=time.perf_counter)
    calls: Dict[str, List[Tuple[float, float]]] = field(default_factory=lambda: {k: [] for k in
                                                                                  ("write", "sync", "allocate", "commit")})
    written_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, start: float, end: float, nbytes: int = 0) -> None:
        with self._lock:
            self.calls[kind].append((start - self.started, end - self.started))
            self.written_bytes += nbytes

    def in_flight_share(self, at_least: int, elapsed: float) -> float:
        """Share of ``elapsed`` with at least ``at_least`` direct writes in flight."""
        edges = sorted([(a, 1) for a, _ in self.calls["write"]] + [(b, -1) for _, b in self.calls["write"]])
        held, last, covered = 0, 0.0, 0.0
        for at, step in edges:
            if held >= at_least:
                covered += at - last
            held += step
            last = at
        return covered / elapsed if elapsed > 0 else 0.0

    def summary(self, elapsed: float, nbytes: int) -> Dict[str, float]:
        writes = self.calls["write"]
        first = min((a for a, _ in writes), default=elapsed)
        last = max((b for _, b in writes), default=elapsed)
        stalls = sum(b - a for a, b in self.calls["allocate"] if b - a > STALL_S)
        return {
            "mb_s": round(mb_s(nbytes, elapsed)),
            "round_ms": round(elapsed * 1e3, 1),
            "first_write_ms": round(first * 1e3, 1),
            "after_last_write_ms": round((elapsed - last) * 1e3, 1),
            "share_1_in_flight": round(self.in_flight_share(1, elapsed), 3),
            "share_2_in_flight": round(self.in_flight_share(2, elapsed), 3),
            "allocation_stall_ms": round(stalls * 1e3, 1),
            "writes": len(writes),
            "written_bytes": self.written_bytes,
        }


def _timed(kind: str, timeline: Callable[[], Optional[WriteTimeline]], fn: Callable[..., Any],
           nbytes: Callable[[Tuple[Any, ...]], int] = lambda _: 0) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            current = timeline()
            if current is not None:
                current.add(kind, start, time.perf_counter(), nbytes(args))
    return timed


@contextlib.contextmanager
def record_io(timeline: Callable[[], Optional[WriteTimeline]]) -> Iterator[None]:
    """While open, every segment write, segment sync, allocation and LMDB write transaction of
    this process's LMDB tiers is added to ``timeline()`` (when it returns one). The functions are
    wrapped where the tier calls them and restored on exit; a probe's own process only."""
    saved = (segments._pwritev_all, segments._fallocate, segments.os.fdatasync, WriterSide.write)
    segments._pwritev_all = _timed("write", timeline, saved[0], lambda a: sum(v.nbytes for v in a[1]))
    segments._fallocate = _timed("allocate", timeline, saved[1])
    segments.os.fdatasync = _timed("sync", timeline, saved[2])
    WriterSide.write = _timed("commit", timeline, saved[3])  # type: ignore[method-assign]
    try:
        yield
    finally:
        segments._pwritev_all, segments._fallocate, segments.os.fdatasync = saved[:3]
        WriterSide.write = saved[3]  # type: ignore[method-assign]


async def _rounds(directory: Path, chunk_bytes: int, round_bytes: int, rounds: int) -> List[Dict[str, float]]:
    per_round = max(1, round_bytes // chunk_bytes)
    meta = ChunkMeta(b"kvtier-bench", 0, 0, "bfloat16", (chunk_bytes // 2,))
    per_batch = max(1, min(BATCH_MAX_CHUNKS, BATCH_BYTES // chunk_bytes))
    current: List[Optional[WriteTimeline]] = [None]
    results = []
    with HostSlabPool(chunk_bytes, per_round) as pool, record_io(lambda: current[0]):
        allocation = pool.allocate(per_round)
        assert allocation is not None, "a fresh pool of n slots has n free"
        source = make_kv_bytes(per_round * chunk_bytes).view(torch.uint8)
        slots = [pool.view(s) for s in allocation.slots]
        for i, slot in enumerate(slots):  # the page-aligned host slots the engine's spill puts from
            slot.copy_(source[i * chunk_bytes : (i + 1) * chunk_bytes])
        chunks = [slot.numpy().data for slot in slots]
        async with await LmdbTier.open(directory, codec=CodecConfig(compress=False)) as tier:
            for r in range(rounds):
                items = [(b"r%04d-%08d" % (r, i), meta, chunks[i]) for i in range(per_round)]
                gate = asyncio.Semaphore(SPILL_BATCHES_IN_FLIGHT)

                async def one(batch: Sequence[Any]) -> None:
                    async with gate:
                        await tier.put_many(batch)

                current[0] = timeline = WriteTimeline()
                await asyncio.gather(*(one(items[i : i + per_batch]) for i in range(0, per_round, per_batch)))
                elapsed = time.perf_counter() - timeline.started
                current[0] = None
                results.append(timeline.summary(elapsed, per_round * chunk_bytes))
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.bench.write_timeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-kib", default="256,1024,4096", help="chunk sizes in KiB (default 256,1024,4096)")
    parser.add_argument("--round-mib", type=int, default=256, help="bytes put per round (default 256 MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", choices=BUSY_KINDS, default=None,
                        help="run the rounds beside CPU-bound workers of this kind (as `kvtier bench --busy`)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvtier-timeline-", dir=args.dir))
    try:
        for kib in (int(x) for x in args.sizes_kib.split(",")):
            with busy(args.busy):
                rows = asyncio.run(_rounds(work / str(kib), kib << 10, args.round_mib * MiB, max(1, args.rounds)))
            medians = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
            if args.json:
                print(json.dumps({"chunk": label_of(kib << 10), "rounds": rows, "median": medians}, sort_keys=True))
            else:
                print(f"{label_of(kib << 10)}: median of {len(rows)} rounds: " +
                      ", ".join(f"{k} {v:g}" for k, v in medians.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
