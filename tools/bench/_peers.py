"""Peers in the disk figures: vLLM's ``fs`` tier, LMCache's local disk backend, SGLang's HiCacheFile,
each as shipped and with a per-file fsync added to its write path, and the O_DIRECT limit of the disk.

Primitives: ``DirectLimit`` (aligned direct writes and reads of runs of adjacent chunks up to
``DIRECT_WRITE_RUN_BYTES`` / ``DIRECT_RUN_BYTES``, ``DIRECT_IN_FLIGHT`` / ``DIRECT_READ_IN_FLIGHT`` in flight),
``VllmFs``, ``LmcacheDisk``, ``SglangFile`` (``DiskSubject``s driving each peer's own I/O code),
``peer_specs()`` (the ``SubjectSpec``s of the peers importable here) and ``PEER_SKIPS`` (one line per
peer that is not, with the reason). Every subject runs its I/O on its own threads; the bench's event
loop only waits.

How each peer runs, and why that is its shipped path:
- vLLM 0.33 ``fs`` (``vllm.v1.kv_offload.tiering.fs.io``): ``batch_store_block`` / ``batch_load_block``
  per store or load job, jobs on 16 threads as ``FileSystemTierManager``'s pools run them, file names
  from vLLM's ``FileMapper``, O_DIRECT when ``probe_o_direct`` says the directory takes it. Its C
  extension needs CUDA libraries, so on a CPU machine vLLM itself takes this pure-Python path.
- LMCache 0.5.6 ``LocalDiskBackend``: ``batched_submit_put_task`` (its 4 disk-worker threads; put
  completes when every callback fired) and, after the page cache is dropped, its
  ``_load_chunk_into_memory`` on its own read pool (what ``batched_get_blocking`` does, reading into
  the bench's preallocated buffers instead of freshly allocated ones). Default config: no O_DIRECT.
- SGLang 0.5.23 ``HiCacheFile``: ``batch_set`` / ``batch_get`` on one thread, as HiCache's storage
  thread calls them.
None of them fsyncs. The "+fsync" variants add ``os.fsync`` of each file right after the peer wrote
it (same thread), so their durability matches kvtier's acknowledged writes.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from kvtier.tiers.lmdb.segments import RUN_BYTES, WRITE_RUN_BYTES, WRITES_IN_FLIGHT
from kvtier.tiers.lmdb.tier import DEFAULT_READ_WORKERS

from ._report import judge
from ._settings import MiB
from ._subjects import DiskSubject, PooledSubject, RowContext, SubjectSpec

__all__ = ["DirectLimit", "direct_runs", "DIRECT_RUN_BYTES", "DIRECT_WRITE_RUN_BYTES", "VllmFs", "LmcacheDisk", "SglangFile", "peer_specs", "PEER_SKIPS", "DIRECT_IN_FLIGHT",
           "DIRECT_READ_IN_FLIGHT"]

DIRECT_IN_FLIGHT = WRITES_IN_FLIGHT  # direct writes in flight for the limit: as kvtier's segment writes
# ... and direct reads: as many as kvtier's read threads (each has one read in flight), so the limit
# reads the way the tier can at best
DIRECT_READ_IN_FLIGHT = DEFAULT_READ_WORKERS
DIRECT_RUN_BYTES = RUN_BYTES  # the limit's largest read: kvtier's segments.RUN_BYTES (4 MiB)
# ... and its largest write: kvtier's segments.WRITE_RUN_BYTES (16 MiB; beside CPU-bound threads
# the larger writes move more, so a limit of 4 MiB writes would be a weaker one than kvtier's)
DIRECT_WRITE_RUN_BYTES = WRITE_RUN_BYTES
VLLM_THREADS = 16  # FileSystemTierManager's n_read_threads / n_write_threads defaults
VLLM_JOB_BYTES = 16 * MiB  # one store/load job: a request's new blocks over one scheduler step
PAGE = mmap.PAGESIZE
# The targets README's benchmark tables list, as ratios to the peers and to the limit measured in the same run.
TARGET_WRITE_VS_PEERS = 1.0
TARGET_WRITE_VS_DIRECT = 0.9
TARGET_READ_VS_PEERS = 1.0
TARGET_READ_VS_DIRECT = 0.9

PEER_SKIPS: List[str] = []


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def in_flight(indices: range, each: Callable[[int], None]) -> List[Callable[[], None]]:
    """``DIRECT_IN_FLIGHT`` jobs (for ``run_threads``) dealing ``indices`` round-robin, each running
    ``each`` on its share in order."""
    def job(part: int) -> Callable[[], None]:
        def run() -> None:
            for i in indices[part::DIRECT_IN_FLIGHT]:
                each(i)
        return run

    return [job(p) for p in range(DIRECT_IN_FLIGHT)]


def direct_runs(indices: range, chunk_bytes: int, run_bytes: int = DIRECT_RUN_BYTES) -> List[range]:
    """``indices`` cut into runs of adjacent chunks of at most ``run_bytes`` (one chunk at least),
    as kvtier's segments move adjacent records: one vectored direct I/O a run."""
    per = max(1, run_bytes // chunk_bytes)
    return [range(i, min(i + per, indices.stop)) for i in range(indices.start, indices.stop, per)]


class DirectLimit(PooledSubject):
    """The disk's O_DIRECT limit, moved the way kvtier's segments could best move it: one file per
    round, its blocks allocated first (``fallocate``), adjacent chunks in runs of up to
    ``DIRECT_WRITE_RUN_BYTES`` (16 MiB, kvtier's write runs), each run one aligned ``pwritev``
    straight from the page-aligned host slots, ``DIRECT_IN_FLIGHT`` threads, one ``fdatasync`` at
    the end; read back in runs of up to ``DIRECT_RUN_BYTES`` (4 MiB: a 256 KiB chunk is one of 16 in
    an I/O, a 4 MiB one alone), one aligned ``preadv`` a run into the page-aligned restore buffers,
    ``DIRECT_READ_IN_FLIGHT`` in flight (the tier's read threads). (Chunk-sized I/Os would make the limit at
    256 KiB a limit of small requests, which the tier, reading runs of adjacent records, beats.)"""

    name = "O_DIRECT"

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview]) -> None:
        super().__init__(directory, chunks, outs, threads=max(DIRECT_IN_FLIGHT, DIRECT_READ_IN_FLIGHT),
                         thread_name_prefix="bench-direct")

    def _path(self, indices: range) -> str:
        return str(self.directory / f"direct-{indices.start}.bin")

    def _jobs(self, indices: range, each: Callable[[range], None], run_bytes: int, lanes: int
              ) -> List[Callable[[], None]]:
        runs = direct_runs(indices, self.chunks[0].nbytes, run_bytes)

        def lane(part: List[range]) -> Callable[[], None]:
            def run() -> None:
                for r in part:
                    each(r)
            return run

        return [lane(runs[k::lanes]) for k in range(min(len(runs), lanes))]

    async def write(self, indices: range) -> float:
        size = self.chunks[0].nbytes
        fd = os.open(self._path(indices), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            # Blocks allocated first: direct writes inside the file's size run side by side, where
            # extending ones to one file are serialised by the filesystem (as kvtier's segments do).
            os.posix_fallocate(fd, 0, len(indices) * size)

            def put(run: range) -> None:
                if os.pwritev(fd, [self.chunks[i] for i in run], (run.start - indices.start) * size) != len(run) * size:
                    raise OSError("short direct write")

            started = time.perf_counter()
            await self.run_threads(self._jobs(indices, put, DIRECT_WRITE_RUN_BYTES, DIRECT_IN_FLIGHT))
            os.fdatasync(fd)
            return time.perf_counter() - started
        finally:
            os.close(fd)

    async def read(self, indices: range) -> float:
        size = self.chunks[0].nbytes
        fd = os.open(self._path(indices), os.O_RDONLY | os.O_DIRECT)
        try:
            def get(run: range) -> None:
                if os.preadv(fd, [self.outs[i] for i in run], (run.start - indices.start) * size) != len(run) * size:
                    raise OSError("short direct read")

            started = time.perf_counter()
            await self.run_threads(self._jobs(indices, get, DIRECT_RUN_BYTES, DIRECT_READ_IN_FLIGHT))
            return time.perf_counter() - started
        finally:
            os.close(fd)


class VllmFs(PooledSubject):
    """vLLM 0.33's ``fs`` secondary tier (see the module docstring)."""

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview], *,
                 fsync: bool) -> None:
        super().__init__(directory, chunks, outs, threads=VLLM_THREADS, thread_name_prefix="bench-vllm")
        self.fsync = fsync
        self.name = "vllm fs" + (" +fsync" if fsync else "")
        self.paths_of: List[str] = []
        self.o_direct = False

    @staticmethod
    def preload() -> None:
        """Import what this subject runs, before any busy round: beside GIL-holding threads
        vLLM's import (thousands of file reads, each returning behind them) took over 15 minutes."""
        _probe_vllm()

    async def setup(self) -> None:
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.kv_offload.file_mapper import FileMapper
        from vllm.v1.kv_offload.tiering.fs.io import probe_o_direct

        await super().setup()
        mapper = FileMapper(str(self.directory), model_name="kvtier-bench", tokens_per_hash=16, blocks_per_file=1,
                            tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="bfloat16")
        self.paths_of = [mapper.get_file_name(make_offload_key(os.urandom(32), 0)) for _ in self.chunks]
        self.o_direct = probe_o_direct(str(self.directory))

    def _jobs(self, indices: range) -> List[range]:
        per = max(1, VLLM_JOB_BYTES // self.chunks[0].nbytes)
        return [range(i, min(i + per, indices.stop)) for i in range(indices.start, indices.stop, per)]

    async def _timed_jobs(self, indices: range, per_chunk: Callable[[int], None]) -> float:
        """Seconds to run ``per_chunk(i)`` for every chunk of ``indices``, in vLLM's jobs on its pool."""

        def job(chunks: range) -> Callable[[], None]:
            def run() -> None:
                for i in chunks:
                    per_chunk(i)
            return run

        started = time.perf_counter()
        await self.run_threads([job(r) for r in self._jobs(indices)])
        return time.perf_counter() - started

    async def write(self, indices: range) -> float:
        from vllm.v1.kv_offload.tiering.fs.io import batch_store_block

        size = self.chunks[0].nbytes

        def store(i: int) -> None:  # the pure-Python path stores block by block; fsync each after
            batch_store_block([self.paths_of[i]], self.chunks[i], [0], size, self.o_direct)
            if self.fsync:
                _fsync_path(self.paths_of[i])

        return await self._timed_jobs(indices, store)

    async def read(self, indices: range) -> float:
        from vllm.v1.kv_offload.tiering.fs.io import batch_load_block

        size = self.chunks[0].nbytes
        return await self._timed_jobs(
            indices, lambda i: batch_load_block([self.paths_of[i]], self.outs[i], [0], size, self.o_direct)
        )


class LmcacheDisk(DiskSubject):
    """LMCache 0.5.6's ``LocalDiskBackend`` (see the module docstring)."""

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview], *,
                 fsync: bool) -> None:
        super().__init__(directory, chunks, outs)
        self.fsync = fsync
        self.name = "lmcache disk" + (" +fsync" if fsync else "")
        self.backend: Any = None
        self.keys: List[Any] = []
        self.write_objs: List[Any] = []
        self.read_objs: List[Any] = []

    async def setup(self) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        await super().setup()
        size = self.chunks[0].nbytes
        total_gib = (len(self.chunks) * size) / (1 << 30) + 0.5
        config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, max_local_cpu_size=0.1,
                                                   local_disk=str(self.directory), max_local_disk_size=total_gib)
        cpu = LocalCPUBackend(config, memory_allocator=AdHocMemoryAllocator("cpu"))
        backend_cls = LocalDiskBackend
        if self.fsync:
            class FsyncLocalDiskBackend(LocalDiskBackend):  # its write_file, then fsync of the file
                def write_file(self, buffer: Any, path: str) -> None:
                    super().write_file(buffer, path)
                    _fsync_path(path)

            backend_cls = FsyncLocalDiskBackend
        self.backend = backend_cls(config, asyncio.get_running_loop(), cpu, "cpu")

        def objs(views: Sequence[memoryview]) -> List[Any]:
            return [
                TensorMemoryObj(torch.frombuffer(v, dtype=torch.uint8),
                                MemoryObjMetadata(torch.Size([size // 2]), torch.bfloat16, 0, size, 1,
                                                  fmt=MemoryFormat.KV_2LTD), None)
                for v in views
            ]

        self.keys = [CacheEngineKey("kvtier-bench", 1, 0, i, torch.bfloat16) for i in range(len(self.chunks))]
        self.write_objs, self.read_objs = objs(self.chunks), objs(self.outs)

    async def write(self, indices: range) -> float:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        left = [len(indices)]

        def finish() -> None:  # on the loop
            if not done.done():
                done.set_result(None)

        def completed(_key: Any) -> None:  # on LMCache's worker threads
            left[0] -= 1
            if left[0] == 0:
                loop.call_soon_threadsafe(finish)

        started = time.perf_counter()
        self.backend.batched_submit_put_task([self.keys[i] for i in indices], [self.write_objs[i] for i in indices],
                                             on_complete_callback=completed)
        await done
        return time.perf_counter() - started

    async def read(self, indices: range) -> float:
        backend = self.backend
        keys = [self.keys[i] for i in indices]
        paths = [backend.dict[k].path for k in keys]
        objs = [self.read_objs[i] for i in indices]
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        results = await loop.run_in_executor(
            None, lambda: list(backend._read_thread_pool.map(backend._load_chunk_into_memory, keys, paths, objs)))
        elapsed = time.perf_counter() - started
        if any(r is None for r in results):
            raise OSError("lmcache disk: a chunk failed to load")
        return elapsed

    async def teardown(self) -> List[str]:
        if self.backend is not None:  # its close joins workers that need this loop running: off the loop
            await asyncio.get_running_loop().run_in_executor(None, self.backend.close)
        return []


class SglangFile(PooledSubject):
    """SGLang 0.5.23's ``HiCacheFile`` (see the module docstring)."""

    def __init__(self, directory: Path, chunks: Sequence[memoryview], outs: Sequence[memoryview], *,
                 fsync: bool) -> None:
        super().__init__(directory, chunks, outs, threads=1, thread_name_prefix="bench-sglang")
        self.fsync = fsync
        self.name = "sglang file" + (" +fsync" if fsync else "")
        self.store: Any = None
        self.values: List[Any] = []
        self.targets: List[Any] = []

    async def setup(self) -> None:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        await super().setup()
        config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                      is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                      model_name="kvtier-bench")
        store_cls = HiCacheFile
        if self.fsync:
            class FsyncHiCacheFile(HiCacheFile):  # its set, then fsync of the file it wrote
                def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
                        target_sizes: Optional[Any] = None) -> bool:
                    ok = super().set(key, value, target_location, target_sizes)
                    _fsync_path(os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin"))
                    return ok

            store_cls = FsyncHiCacheFile
        self.store = store_cls(config, file_path=str(self.directory))
        self.values = [torch.frombuffer(c, dtype=torch.uint8) for c in self.chunks]
        self.targets = [torch.frombuffer(o, dtype=torch.uint8) for o in self.outs]

    async def _timed_batch(self, call: Callable[[List[str], List[Any]], Any], indices: range,
                           tensors: Sequence[Any]) -> Tuple[Any, float]:
        """``call(keys, tensors)`` for the chunks of ``indices`` on the pool: (its answer, seconds)."""
        keys = [f"chunk{i}" for i in indices]
        batch = [tensors[i] for i in indices]
        started = time.perf_counter()
        answer = await asyncio.get_running_loop().run_in_executor(self.pool, call, keys, batch)
        return answer, time.perf_counter() - started

    async def write(self, indices: range) -> float:
        ok, elapsed = await self._timed_batch(self.store.batch_set, indices, self.values)
        if not ok:
            raise OSError("sglang file: batch_set failed")
        return elapsed

    async def read(self, indices: range) -> float:
        got, elapsed = await self._timed_batch(self.store.batch_get, indices, self.targets)
        if any(g is None for g in got):
            raise OSError("sglang file: batch_get missed a chunk")
        return elapsed


# ------------------------------------------------------------------------------------ the registry

_KVTIER = "lmdb raw"  # kvtier's disk tier as shipped for these rows (TIER_SUBJECTS' "lmdb-raw")


def _direct_rows(ctx: RowContext) -> None:
    label = ctx.label
    def io(run_bytes: int, lanes: int) -> str:
        return f"{lanes} x {max(ctx.size, run_bytes) // MiB} MiB I/Os in flight"

    ctx.add(f"O_DIRECT write+fdatasync, {io(DIRECT_WRITE_RUN_BYTES, DIRECT_IN_FLIGHT)} {label}", "O_DIRECT", "write",
            "raw", "raw fdatasync write")
    ctx.add(f"O_DIRECT cold read, {io(DIRECT_RUN_BYTES, DIRECT_READ_IN_FLIGHT)} {label}", "O_DIRECT", "read", "raw",
            "raw cold read")
    row = ctx.add(f"kvtier lmdb write vs O_DIRECT limit {label}", _KVTIER, "write", "O_DIRECT", "O_DIRECT write")
    if ctx.size >= 1 * MiB:
        row.target = f">= {TARGET_WRITE_VS_DIRECT}x"
        judge(row, TARGET_WRITE_VS_DIRECT)
    judge(ctx.add(f"kvtier lmdb cold read vs O_DIRECT limit {label}", _KVTIER, "read", "O_DIRECT",
                  "O_DIRECT cold read", target=f">= {TARGET_READ_VS_DIRECT}x"), TARGET_READ_VS_DIRECT)


def _peer_rows(peer: str) -> Callable[[RowContext], None]:
    def rows(ctx: RowContext) -> None:
        name, label = ctx.subject.name, ctx.label
        if name.endswith("+fsync"):
            judge(ctx.add(f"kvtier lmdb write vs {name} {label}", _KVTIER, "write", name, f"{name} write",
                          target=f">= {TARGET_WRITE_VS_PEERS}x"), TARGET_WRITE_VS_PEERS)
        else:
            ctx.add(f"{name} write (no fsync) {label}", name, "write", "raw", "raw fdatasync write")
            judge(ctx.add(f"kvtier lmdb cold read vs {name} {label}", _KVTIER, "read", name, f"{name} cold read",
                          target=f">= {TARGET_READ_VS_PEERS}x"), TARGET_READ_VS_PEERS)
    return rows


def _importable(peer: str, probe: Callable[[], None]) -> bool:
    try:
        probe()
        return True
    except Exception as exc:  # noqa: BLE001 - any import failure means: not on this machine
        PEER_SKIPS.append(f"{peer}: skipped, its import fails here ({type(exc).__name__}: {exc})"[:300])
        return False


def _probe_vllm() -> None:
    from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: F401
    from vllm.v1.kv_offload.tiering.fs.io import batch_store_block  # noqa: F401


def _probe_lmcache() -> None:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # it logs every put and get at INFO on stdout
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401


def _probe_sglang() -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: F401


def peer_specs(directory_probe: Optional[Path] = None, *, peers: bool = True) -> List[SubjectSpec]:
    """The subjects of this module that can run here, in run order; ``PEER_SKIPS`` says why the
    others do not. ``directory_probe``: where O_DIRECT must work for the limit to run; ``peers``
    False: the O_DIRECT limit only."""
    PEER_SKIPS.clear()
    if not peers:
        PEER_SKIPS.append("peers (vLLM fs, LMCache disk, SGLang file): not in this run (peers off)")
    specs: List[SubjectSpec] = []
    if directory_probe is not None and not _direct_io_works(directory_probe):
        PEER_SKIPS.append(f"O_DIRECT limit: skipped, {directory_probe} does not take O_DIRECT")
    else:
        specs.append(SubjectSpec("direct", DirectLimit, _direct_rows))
    for peer, probe, cls, prefix in () if not peers else (
        ("vLLM 0.33 fs tier", _probe_vllm, VllmFs, "vllm"),
        ("LMCache 0.5.6 local disk", _probe_lmcache, LmcacheDisk, "lmcache"),
        ("SGLang 0.5.23 HiCacheFile", _probe_sglang, SglangFile, "sglang"),
    ):
        if _importable(peer, probe):
            for fsync in (False, True):
                specs.append(SubjectSpec(f"{prefix}{'-fsync' if fsync else ''}",
                                         functools.partial(cls, fsync=fsync),
                                         _peer_rows(prefix)))
    return specs


def _direct_io_works(directory: Path) -> bool:
    path = directory / ".kvtier-odirect-probe"
    page = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        try:
            os.unlink(path)
        except OSError:
            pass
