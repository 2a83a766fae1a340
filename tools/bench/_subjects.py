"""The things the disk figures time: each writes chunk ranges durably and reads them back cold.

Primitives: ``DiskSubject`` (the interface), ``RawFile`` (the limit), ``FilePerChunk`` (the baseline
a user would otherwise pick), ``TierSubject`` (a kvtier ``ChunkTier``), ``EngineSubject`` (end to
end), and ``TIER_SUBJECTS``: the registry of subjects the ``tiers`` part runs at every chunk size,
each with the rows it reports. To add a subject (a peer library, the remote tier), append a
``SubjectSpec`` to ``TIER_SUBJECTS`` (from your own module, imported by ``tools/bench/_run.py``):
its ``make`` builds the subject for one chunk size, its ``rows`` adds its figures to the report.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import xxhash

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.files import FileTier
from kvtier.tiers.lmdb import DEFAULT_SEGMENT_THRESHOLD_BYTES, LmdbTier
from kvtier.tiers.record_format import CodecConfig

from ._kv import KVGeometry
from ._report import BenchReport, BenchRow, judge
from ._settings import (
    BATCH_BYTES,
    BATCH_MAX_CHUNKS,
    BASELINE_FILES_IN_FLIGHT,
    MiB,
    SPILL_BATCHES_IN_FLIGHT,
    TARGET_RESTORE_VS_RAW,
    TARGET_SMALL_SPILL_VS_BASELINE,
    TARGET_SPILL_VS_RAW,
)

__all__ = [
    "DiskSubject",
    "PooledSubject",
    "RawFile",
    "FilePerChunk",
    "TierSubject",
    "EngineSubject",
    "SubjectSpec",
    "RowContext",
    "TIER_SUBJECTS",
]

def _chunk_key(tag: str, index: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{tag}:{index}".encode()) * 2


def _batches(items: List[Any], chunk_bytes: int) -> List[List[Any]]:
    per = max(1, min(BATCH_MAX_CHUNKS, BATCH_BYTES // chunk_bytes))
    return [items[i : i + per] for i in range(0, len(items), per)]


class DiskSubject:
    """One thing that writes chunk ranges durably and reads them back cold. ``write``/``read``
    return seconds; ``read`` fills ``outs`` (the driver checks them) unless ``checks_outs`` is
    False. ``paths``: what the page-cache drop must cover."""

    name = "subject"
    checks_outs = True

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview]) -> None:
        self.directory = directory
        self.chunks = chunks
        self.outs = outs

    async def setup(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    async def write(self, indices: range) -> float:
        raise NotImplementedError

    async def restart(self) -> None:
        """Between the write and the read rounds (a reopen, where the subject has one)."""

    async def read(self, indices: range) -> float:
        raise NotImplementedError

    async def teardown(self) -> List[str]:
        """Close; return failures found (wrong bytes)."""
        return []

    def paths(self) -> List[Path]:
        return [self.directory]


class PooledSubject(DiskSubject):
    """A subject whose I/O runs on its own thread pool of ``threads`` workers (``run_threads``),
    shut down at teardown."""

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview], *,
                 threads: int, thread_name_prefix: str) -> None:
        super().__init__(directory, chunks, outs)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=thread_name_prefix)

    async def run_threads(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run every job on the pool at once; return when all are done."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self.pool, job) for job in jobs))

    async def teardown(self) -> List[str]:
        self.pool.shutdown(wait=True)
        return []


class RawFile(DiskSubject):
    """The limit: one file per round written sequentially, one ``fdatasync`` at the end; read back
    sequentially, chunk-sized reads into the preallocated buffers."""

    name = "raw"

    def _path(self, indices: range) -> Path:
        return self.directory / f"raw-{indices.start}.bin"

    async def write(self, indices: range) -> float:
        fd = os.open(self._path(indices), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            started = time.perf_counter()
            for i in indices:
                view = self.chunks[i]
                while view.nbytes:
                    view = view[os.write(fd, view) :]
            os.fdatasync(fd)
            return time.perf_counter() - started
        finally:
            os.close(fd)

    async def read(self, indices: range) -> float:
        fd = os.open(self._path(indices), os.O_RDONLY)
        try:
            started = time.perf_counter()
            for i in indices:
                if os.readv(fd, [self.outs[i]]) != self.outs[i].nbytes:
                    raise OSError(f"short read of {self._path(indices)}")
            return time.perf_counter() - started
        finally:
            os.close(fd)


class FilePerChunk(DiskSubject):
    """The baseline a user would otherwise pick (LMCache's and vLLM's file tiers): one file per
    chunk with aiofiles, temp file + fsync + rename, every chunk of a round gathered at once on the
    default executor (no directory fsync: those tiers do not make one either); read back with
    ``aiofiles`` ``read()`` and a copy into the buffer."""

    name = "file-per-chunk"

    async def write(self, indices: range) -> float:
        import aiofiles
        import aiofiles.os

        loop = asyncio.get_running_loop()
        # Bounded only so that thousands of chunks do not exhaust file descriptors: the executor
        # (min(32, cpus + 4) threads) is the real limit on parallel I/O, as it is for such tiers.
        in_flight = asyncio.Semaphore(BASELINE_FILES_IN_FLIGHT)

        async def one(i: int) -> None:
            tmp = self.directory / f"{i}.tmp"
            async with in_flight:
                async with aiofiles.open(tmp, "wb") as f:
                    await f.write(self.chunks[i])
                    await f.flush()
                    await loop.run_in_executor(None, os.fsync, f.fileno())
                await aiofiles.os.replace(tmp, self.directory / f"{i}.kv")

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in indices))
        return time.perf_counter() - started

    async def read(self, indices: range) -> float:
        import aiofiles

        in_flight = asyncio.Semaphore(BASELINE_FILES_IN_FLIGHT)

        async def one(i: int) -> None:
            async with in_flight:
                async with aiofiles.open(self.directory / f"{i}.kv", "rb") as f:
                    data = await f.read()
            self.outs[i][:] = data

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in indices))
        return time.perf_counter() - started


class TierSubject(DiskSubject):
    """A kvtier ``ChunkTier`` (LMDB or files): ``put_many`` in the engine's spill batches (64 MiB or
    256 chunks), up to ``SPILL_BATCHES_IN_FLIGHT`` batches in flight as the engine's spill keeps
    them; closed and reopened between the rounds; ``get_many_into`` in the same batches, all of a
    round's in flight at once (as the engine loads a round's requests), straight into the buffers."""

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview], *,
                 kind: str, compress: bool,
                 segment_threshold_bytes: Optional[int] = DEFAULT_SEGMENT_THRESHOLD_BYTES) -> None:
        super().__init__(directory, chunks, outs)
        self.kind = kind
        self.compress = compress
        # LMDB only: records >= it go to segments. The tier's default is kvtier as shipped ("lmdb
        # raw"); None keeps every record inside LMDB ("lmdb inline raw"); another value is named so.
        self.segment_threshold_bytes = segment_threshold_bytes
        if kind != "lmdb" or segment_threshold_bytes == DEFAULT_SEGMENT_THRESHOLD_BYTES:
            variant = ""
        else:
            variant = " segments" if segment_threshold_bytes else " inline"
        self.name = f"{kind}{variant} {'zstd' if compress else 'raw'}"
        size = chunks[0].nbytes
        self.meta = ChunkMeta(b"kvtier-bench", 0, 0, "bfloat16", (size // 2,))
        self.tier: Any = None
        self.stats: Dict[str, float] = {}

    async def _open(self) -> None:
        codec = CodecConfig(compress=self.compress)
        if self.kind == "lmdb":
            self.tier = await LmdbTier.open(
                self.directory, codec=codec, segment_threshold_bytes=self.segment_threshold_bytes
            )
        else:
            self.tier = await FileTier.open(self.directory, codec=codec)

    async def setup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        await self._open()

    def _key(self, i: int) -> bytes:
        return _chunk_key(self.kind, i)

    async def write(self, indices: range) -> float:
        items = [(self._key(i), self.meta, self.chunks[i]) for i in indices]
        batches = _batches(items, self.chunks[0].nbytes)
        gate = asyncio.Semaphore(SPILL_BATCHES_IN_FLIGHT)

        async def one(batch: List[Any]) -> None:
            async with gate:
                await self.tier.put_many(batch)

        started = time.perf_counter()
        await asyncio.gather(*(one(b) for b in batches))
        return time.perf_counter() - started

    async def restart(self) -> None:
        self.stats = self.tier.statistics().as_dict()
        await self.tier.close()
        await self._open()

    async def read(self, indices: range) -> float:
        items = [(self._key(i), self.outs[i]) for i in indices]
        started = time.perf_counter()
        # Every batch of the round at once: the engine's loads of a round's requests are all in
        # flight together (EngineSubject), each one get_many_into of its window, as the peers and
        # the limit read the whole round at once. One batch at a time left the disk idle while
        # each batch's last slices finished, something no caller of the engine does.
        await asyncio.gather(*(self.tier.get_many_into(b) for b in _batches(items, self.chunks[0].nbytes)))
        return time.perf_counter() - started

    async def teardown(self) -> List[str]:
        if self.tier is not None:
            await self.tier.close()
        return []

    def stored_ratio(self) -> float:
        if self.kind == "lmdb":
            raw, stored = self.stats.get("raw_bytes_in", 0.0), self.stats.get("stored_bytes_in", 0.0)
        else:
            raw, stored = float(sum(c.nbytes for c in self.chunks)), self.stats.get("bytes", 0.0)
        return raw / stored if stored else 1.0


class EngineSubject(DiskSubject):
    """End to end through ``OffloadEngine`` with its LMDB cache (default codec: zstd byte planes).
    Write: the round's requests (up to 64 MiB each) are stored at once, until every chunk is
    durable. Restart: the engine is closed and the device blocks zeroed; a fresh engine opens the
    same directory. Read: every request of the round is looked up (one more token) and loaded into
    its device blocks, all loads in flight together. Teardown checks the device bytes (xxh3-128)."""

    name = "engine"
    checks_outs = False

    def __init__(self, directory: Path, kv: torch.Tensor, geometry: KVGeometry, num_chunks: int,
                 rounds: Sequence[range], seed: int = 0) -> None:
        super().__init__(directory, [], [])
        self.geometry = geometry
        self.view = geometry.device_view(kv, num_chunks)
        self.device_bytes = kv.view(torch.uint8)[: num_chunks * geometry.chunk_bytes]
        per_request = max(1, BATCH_BYTES // geometry.chunk_bytes)
        rng = random.Random(seed)
        self.requests: Dict[int, List[Tuple[List[int], List[List[int]]]]] = {}
        for r in rounds:
            reqs = []
            for first in range(r.start, r.stop, per_request):
                last = min(first + per_request, r.stop)
                tokens = [rng.randrange(1, 32000) for _ in range((last - first) * geometry.tokens_per_chunk)]
                reqs.append((tokens, [[b for c in range(first, last) for b in geometry.block_ids(c)]]))
            self.requests[r.start] = reqs
        self.config = EngineConfig(
            cache_dir=str(directory),
            host_capacity_bytes=num_chunks * geometry.chunk_bytes,
            store_queue_max_chunks=max(4096, num_chunks),
        )
        self.engine: Optional[OffloadEngine] = None
        self.digest = b""
        self.released_s = 0.0
        self.failures: List[str] = []

    async def _open(self) -> None:
        # No pressure sources: a throughput run must not have its stores dropped because the noisy
        # disk was slow for a second (the back-off itself is tested, not benchmarked).
        self.engine = OffloadEngine(self.geometry.layout, self.view, self.config, fingerprint=b"kvtier-bench-e2e",
                                    pressure_sources={"disk_write_latency": lambda: 0.0})
        await self.engine.start()

    async def setup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.digest = xxhash.xxh3_128_digest(self.device_bytes.numpy().data)
        await self._open()

    async def write(self, indices: range) -> float:
        assert self.engine is not None
        reqs = self.requests[indices.start]
        keys = [self.engine.request_keys(tokens) for tokens, _ in reqs]
        started = time.perf_counter()
        handles = [self.engine.store(k, table) for k, (_, table) in zip(keys, reqs)]
        await asyncio.gather(*(h.wait_released() for h in handles))
        self.released_s += time.perf_counter() - started
        durable = await asyncio.gather(*(h.wait_durable() for h in handles))
        elapsed = time.perf_counter() - started
        if not all(durable) or any(h.dropped for h in handles):
            self.failures.append(f"engine: round at chunk {indices.start} not stored durably")
        return elapsed

    async def restart(self) -> None:
        assert self.engine is not None
        await self.engine.close()
        self.device_bytes.zero_()
        await self._open()

    async def read(self, indices: range) -> float:
        assert self.engine is not None
        reqs = self.requests[indices.start]
        keys = [self.engine.request_keys(tokens + [0]) for tokens, _ in reqs]
        started = time.perf_counter()
        hits = [self.engine.lookup(k) for k in keys]
        results = await asyncio.gather(*(self.engine.load(k, h or 0, t) for k, h, (_, t) in zip(keys, hits, reqs)))
        elapsed = time.perf_counter() - started
        if hits != [len(tokens) for tokens, _ in reqs] or not all(r.ok for r in results):
            self.failures.append(f"engine: round at chunk {indices.start}: hits {hits}, "
                                 f"{[r.reason for r in results if not r.ok]}")
        elif sum(r.chunks_from_disk for r in results) != len(indices):
            self.failures.append(f"engine: round at chunk {indices.start} was not read from disk")
        return elapsed

    async def teardown(self) -> List[str]:
        if self.engine is not None:
            self.engine.check()
            await self.engine.close()
        if xxhash.xxh3_128_digest(self.device_bytes.numpy().data) != self.digest:
            self.failures.append("engine: device bytes after the loads differ from those stored")
        return self.failures


# ------------------------------------------------------------------------------------ the registry


@dataclass
class RowContext:
    """What a subject's ``rows`` gets after the paired rounds of one chunk size: ``add(name,
    subject, kind, reference, reference_label, **kw)`` adds a MB/s row for ``subject``'s
    ``kind`` ("write" / "read") with its median ratio to ``reference`` (a subject name: "raw",
    "file-per-chunk", ...); ``report`` for other rows; ``subject`` is the instance that ran."""

    add: Callable[..., BenchRow]
    report: BenchReport
    label: str
    size: int
    subject: "DiskSubject"


@dataclass(frozen=True)
class SubjectSpec:
    """One registered subject: ``directory`` prefix (``<prefix>-<size label>`` under the work
    directory), ``make(directory, chunks, outs)`` builds it, ``rows(ctx)`` reports it."""

    directory: str
    make: Callable[[Path, Sequence[memoryview], Sequence[memoryview]], "DiskSubject"]
    rows: Callable[[RowContext], None]


_BASELINE = "file-per-chunk"


def _baseline_rows(ctx: RowContext) -> None:
    ctx.add(f"file-per-chunk write (aiofiles, fsync, rename) {ctx.label}", _BASELINE, "write", "raw",
            "raw fdatasync write")
    ctx.add(f"file-per-chunk cold read {ctx.label}", _BASELINE, "read", "raw", "raw cold read")


def _lmdb_rows(ctx: RowContext) -> None:
    codec = "zstd" if ctx.subject.compress else "raw"  # type: ignore[attr-defined]
    name, label = ctx.subject.name, ctx.label
    row = ctx.add(f"lmdb spill {codec} codec {label}", name, "write", "raw", "raw fdatasync write")
    if ctx.size >= 1 * MiB:
        row.target = f">= {TARGET_SPILL_VS_RAW}x"
        judge(row, TARGET_SPILL_VS_RAW)
    row = ctx.add(f"lmdb spill {codec} codec {label} vs baseline", name, "write", _BASELINE, "file-per-chunk write")
    if ctx.size < 1 * MiB:
        row.target = f">= {TARGET_SMALL_SPILL_VS_BASELINE}x"
        judge(row, TARGET_SMALL_SPILL_VS_BASELINE)
    judge(ctx.add(f"lmdb cold restore {codec} codec {label}", name, "read", "raw", "raw cold read",
                  target=f">= {TARGET_RESTORE_VS_RAW}x"), TARGET_RESTORE_VS_RAW)


def _lmdb_inline_rows(ctx: RowContext) -> None:
    """The LMDB tier with every record inline (as before segments), beside the tier as shipped."""
    name, label = ctx.subject.name, ctx.label
    ctx.add(f"lmdb inline spill raw codec {label}", name, "write", "raw", "raw fdatasync write")
    ctx.add(f"lmdb inline cold restore raw codec {label}", name, "read", "raw", "raw cold read")
    ctx.add(f"lmdb spill raw codec {label} vs inline", "lmdb raw", "write", name, "lmdb inline write")
    ctx.add(f"lmdb cold restore raw codec {label} vs inline", "lmdb raw", "read", name, "lmdb inline cold read")


def _lmdb_zstd_rows(ctx: RowContext) -> None:
    _lmdb_rows(ctx)
    assert isinstance(ctx.subject, TierSubject)
    ctx.report.add(f"lmdb zstd stored ratio (randn bf16) {ctx.label}", ctx.subject.stored_ratio(), "x", None,
                   "raw / stored bytes")


def _files_rows(ctx: RowContext) -> None:
    ctx.add(f"file tier put {ctx.label}", ctx.subject.name, "write", _BASELINE, "file-per-chunk write")
    ctx.add(f"file tier cold get {ctx.label}", ctx.subject.name, "read", _BASELINE, "file-per-chunk cold read")


# In run order (the paired rounds alternate it); the baseline first: other rows refer to it.
TIER_SUBJECTS: List[SubjectSpec] = [
    SubjectSpec("baseline", FilePerChunk, _baseline_rows),
    SubjectSpec("lmdb-raw", lambda d, c, o: TierSubject(d, c, o, kind="lmdb", compress=False), _lmdb_rows),
    SubjectSpec("lmdb-zstd", lambda d, c, o: TierSubject(d, c, o, kind="lmdb", compress=True), _lmdb_zstd_rows),
    SubjectSpec("lmdb-inline", lambda d, c, o: TierSubject(d, c, o, kind="lmdb", compress=False,
                                                            segment_threshold_bytes=None), _lmdb_inline_rows),
    SubjectSpec("files", lambda d, c, o: TierSubject(d, c, o, kind="files", compress=False), _files_rows),
]
