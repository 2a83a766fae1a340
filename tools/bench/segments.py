"""Design probe for the disk write path: would payloads in O_DIRECT segment files beat LMDB's durable writes?

Primitives: ``SegmentProbe`` (a ``DiskSubject``: the proposed write path, minimal but complete in
its I/O: checksum, aligned direct appends, fdatasync, then one synced LMDB index commit), ``main``
(``python -m kvtier.tools.bench.segments``). Not a tier: no eviction, quarantine or recovery; it
measures the I/O pattern such a tier would pay, beside the kvtier LMDB tier, the O_DIRECT limit
and the raw write in the same paired rounds (``kvtier.tools.bench._rounds``).

Write of one round: xxh3-64 of every payload; one segment file per round opened O_DIRECT, chunks
appended at page-aligned offsets by ``DIRECT_IN_FLIGHT`` threads straight from the page-aligned
host slots; ``fdatasync``; then one LMDB write transaction (sync + metasync, as the tier's) maps
each key to (segment, offset, length, checksum). Read: one read transaction for the index entries,
aligned ``preadv`` with O_DIRECT into the restore buffers, ``DIRECT_IN_FLIGHT`` in flight, each
payload's checksum verified.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import lmdb
import torch
import xxhash

from kvtier.tiers.host import HostSlabPool

from ._busy import BUSY_KINDS, busy
from ._kv import make_kv_bytes
from ._peers import DIRECT_IN_FLIGHT, DirectLimit, VllmFs, in_flight
from ._rounds import run_paired
from ._settings import MiB, label_of
from ._subjects import DiskSubject, PooledSubject, RawFile, TierSubject

__all__ = ["SegmentProbe", "main"]

_ENTRY = struct.Struct("<QQQQ")  # segment, offset, length, xxh3-64


class SegmentProbe(PooledSubject):
    """The proposed durable write path (see the module docstring)."""

    name = "segments"

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview]) -> None:
        super().__init__(directory, chunks, outs, threads=DIRECT_IN_FLIGHT, thread_name_prefix="bench-segments")
        self.env: Optional[lmdb.Environment] = None

    async def setup(self) -> None:
        await super().setup()
        self.env = lmdb.open(str(self.directory / "index"), map_size=1 << 30, sync=True, metasync=True,
                             writemap=False, mode=0o600)

    def _segment(self, number: int) -> str:
        return str(self.directory / f"segment-{number:08d}.kv")

    async def write(self, indices: range) -> float:
        assert self.env is not None
        size = self.chunks[0].nbytes
        stride = -(-size // 4096) * 4096
        started = time.perf_counter()
        sums = [xxhash.xxh3_64_intdigest(self.chunks[i]) for i in indices]
        fd = os.open(self._segment(indices.start), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            def put(i: int) -> None:
                if os.pwrite(fd, self.chunks[i], (i - indices.start) * stride) != size:
                    raise OSError("short direct write")

            await self.run_threads(in_flight(indices, put))
            os.fdatasync(fd)  # payloads durable before the index that points at them
        finally:
            os.close(fd)
        with self.env.begin(write=True) as txn:
            for n, i in enumerate(indices):
                txn.put(b"k%08d" % i, _ENTRY.pack(indices.start, n * stride, size, sums[n]))
        return time.perf_counter() - started

    @staticmethod
    def _entry(txn: lmdb.Transaction, index: int) -> "bytes | memoryview":
        raw = txn.get(b"k%08d" % index)
        if raw is None:
            raise RuntimeError(f"segment bench: chunk {index} was read before it was written")
        return raw

    async def read(self, indices: range) -> float:
        assert self.env is not None
        started = time.perf_counter()
        with self.env.begin() as txn:
            entries = {i: _ENTRY.unpack(self._entry(txn, i)) for i in indices}
        bad: List[int] = []
        fds: Dict[int, int] = {}
        try:
            for segment, _, _, _ in entries.values():
                if segment not in fds:
                    fds[segment] = os.open(self._segment(segment), os.O_RDONLY | os.O_DIRECT)

            def get(i: int) -> None:
                segment, offset, length, checksum = entries[i]
                if os.preadv(fds[segment], [self.outs[i]], offset) != length:
                    raise OSError("short direct read")
                if xxhash.xxh3_64_intdigest(self.outs[i]) != checksum:
                    bad.append(i)

            await self.run_threads(in_flight(indices, get))
        finally:
            for fd in fds.values():
                os.close(fd)
        if bad:
            raise OSError(f"segments: checksum mismatch on chunks {bad[:5]}")
        return time.perf_counter() - started

    async def teardown(self) -> List[str]:
        if self.env is not None:
            self.env.close()
        return await super().teardown()


# The segment-enabled LMDB tier row: every chunk of every measured size (>= 4 KiB) goes to segments,
# so that the inline and segment rows compare the two paths at each size (what picks the default).
SEGMENT_THRESHOLD_BYTES = 4 << 10


async def _probe(size: int, total: int, rounds: int, work: Path, vllm: bool, inline: bool = True) -> Dict[str, float]:
    n = total // size
    kv = make_kv_bytes(total)
    pool = HostSlabPool(size, n)
    allocation = pool.allocate(n)
    assert allocation is not None, "a fresh pool of n slots has n free"
    slots = [pool.view(s) for s in allocation.slots]
    src = kv.view(torch.uint8)
    for i, slot in enumerate(slots):
        slot.copy_(src[i * size : (i + 1) * size])
    raw = torch.empty(n * size + 4096, dtype=torch.uint8)
    restore = raw[(-raw.data_ptr()) % 4096 :][: n * size]
    restore.fill_(1)
    chunks = [s.numpy().data for s in slots]
    outs = [restore[i * size : (i + 1) * size].numpy().data for i in range(n)]
    label = label_of(size)
    subjects: List[DiskSubject] = [
        DirectLimit(work / f"direct-{label}", chunks, outs),
        TierSubject(work / f"lmdbseg-{label}", chunks, outs, kind="lmdb", compress=False,
                    segment_threshold_bytes=SEGMENT_THRESHOLD_BYTES),
        SegmentProbe(work / f"segments-{label}", chunks, outs),
    ]
    if inline:  # the page-cache paths: slow here (0.1-0.5 GB/s), most of the probe's time
        subjects[:0] = [RawFile(work / f"raw-{label}", chunks, outs),
                        TierSubject(work / f"lmdb-{label}", chunks, outs, kind="lmdb", compress=False,
                                    segment_threshold_bytes=None)]
    if vllm:
        subjects.append(VllmFs(work / f"vllm-{label}", chunks, outs, fsync=True))
    step = n // rounds
    ranges = [range(i * step, (i + 1) * step if i < rounds - 1 else n) for i in range(rounds)]
    times, failures = await run_paired(subjects, ranges, size, outs, chunks)
    if failures:
        raise RuntimeError("; ".join(failures))
    out: Dict[str, float] = {}
    for kind in ("write", "read"):
        pagecache = ["raw", "lmdb inline raw"] if inline else []
        peer = ["vllm fs +fsync"] if vllm else []
        for s in pagecache + ["O_DIRECT", "lmdb segments raw", "segments"] + peer:
            out[f"{s} {kind} MB/s"] = round(times.mb_s(s, kind))
        for s in pagecache[1:] + ["O_DIRECT"] + peer:
            out[f"lmdb-segments/{s} {kind}"] = round(times.ratio("lmdb segments raw", kind, s), 2)
        if inline:
            out[f"segments/lmdb {kind}"] = round(times.ratio("segments", kind, "lmdb inline raw"), 2)
        out[f"segments/O_DIRECT {kind}"] = round(times.ratio("segments", kind, "O_DIRECT"), 2)
        if inline:
            out[f"lmdb/O_DIRECT {kind}"] = round(times.ratio("lmdb inline raw", kind, "O_DIRECT"), 2)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.bench.segments", description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per chunk size (default 256 MiB)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sizes-kib", default="256,1024,4096")
    parser.add_argument("--vllm", action="store_true", help="add vLLM's fs tier + fsync (needs vllm)")
    parser.add_argument("--dir", default=None, help="where to measure (default: a temporary directory)")
    parser.add_argument("--no-inline", action="store_true",
                        help="leave out the page-cache rows (raw write, the all-inline tier): the slow part of a run")
    parser.add_argument("--busy", choices=BUSY_KINDS, default=None,
                        help="run the rounds beside CPU-bound workers of this kind (as `kvtier bench --busy`)")
    args = parser.parse_args(argv)
    if args.vllm:
        VllmFs.preload()
    work = Path(tempfile.mkdtemp(prefix="kvtier-segments-", dir=args.dir))
    try:
        for kib in (int(x) for x in args.sizes_kib.split(",")):
            with busy(args.busy):
                result = asyncio.run(_probe(kib << 10, args.total_mib * MiB, args.rounds, work / str(kib), args.vllm,
                                            inline=not args.no_inline))
            print(f"{label_of(kib << 10)}: " + ", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
