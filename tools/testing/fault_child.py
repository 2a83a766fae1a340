"""Child processes of the fault suite, and the parent side that kills them.

Run as ``python -m kvtier.tools.testing.fault_child COMMAND ...`` (or, for ``spawn_reader``, as a
``multiprocessing`` spawn target). Commands:

- ``spill``: open an ``LmdbTier`` and store batches of chunks from a few concurrent writers until
  killed; after each ``put_many`` returned (durable) it writes one line ``ack <batch> <key hex>...``.
  Another coroutine reads acknowledged chunks back and checks them. For kill -9 tests.
- ``engine-spill``: the same through an ``OffloadEngine`` with a cache directory: ``ack <request>``
  once a request's store is durable. The parent regenerates the request from ``(seed, request)``.
- ``compact-churn``: like ``spill`` with segments of 1 MiB, but each round also puts a scratch
  batch (never acknowledged) and deletes an older one whole, so segments end up partly live, and
  runs ``compact_segments`` (automatic passes run too): ``ack <batch> <keys>``, ``compacted <n>``.
- ``hold-reader``: open the directory read-only with plain LMDB, begin a read transaction and keep
  it (a reader slot pinning a snapshot), print ``holding``, sleep. For kill -9 of a reader.
- ``warmup-writer``: write batches for ``--duration-s`` seconds, deleting batches older than
  ``--window`` (a warmup process that recycles space): ``ack <batch> <keys>`` / ``del <batch>``.

The corruption trials, which drive ``kvtier verify``, are a child of their own (``corrupt_child``);
the deterministic chunks, ``check_cache``, ``run_child`` and ``read_line`` are ``children``'s.

Parent side: ``kill_during_spill`` runs one kill -9 iteration (start a ``spill`` or
``engine-spill`` child, SIGKILL it after a delay, reopen and check: ``check_cache`` /
``check_engine_requests``); ``run_kill_chains`` and ``summarize_kills`` run and report many.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from kvtier.errors import KvtierError

from .children import CacheCheck, check_cache, chunk_content, emit, make_batch, parse_key, read_line, run_child, run_command

if TYPE_CHECKING:
    from kvtier.policy import ModelLayout
    from kvtier.tiers.device import DeviceKVView
    from kvtier.tiers.lmdb import LmdbTier

__all__ = [
    "spawn_reader",
    "engine_request",
    "ENGINE_FINGERPRINT",
    "KillResult",
    "kill_during_spill",
    "run_kill_chains",
    "summarize_kills",
    "check_engine_requests",
]

ENGINE_FINGERPRINT = b"kvtier-fault-suite-engine"


# ---------------------------------------------------------------------------------- commands


async def _open_ready(args: argparse.Namespace, **options: object) -> "LmdbTier":
    """The child's tier (frequent access flushes and reader checks: more writer work to interrupt),
    then ``ready``."""
    from kvtier.tiers.lmdb import LmdbTier

    tier = await LmdbTier.open(args.dir, map_size_bytes=args.map_size_bytes, access_flush_interval_s=0.05,
                               reader_check_interval_s=0.2, **options)
    emit("ready")
    return tier


async def _spill(args: argparse.Namespace) -> None:
    tier = await _open_ready(args, segment_threshold_bytes=args.segment_threshold_bytes)
    rng = random.Random(args.seed)
    next_batch = iter(range(1 << 30))
    acked: List[bytes] = []

    async def writer() -> None:
        while True:
            batch = next(next_batch)
            sizes = [rng.choice((700, 4096, 30000, 65536, 131072)) for _ in range(rng.randint(1, args.max_batch))]
            items = make_batch(args.seed, batch, sizes)
            await tier.put_many(items)
            emit(f"ack {batch} " + " ".join(k.hex() for k, _, _ in items))
            acked.extend(k for k, _, _ in items)

    async def reader() -> None:  # reads make access-time writes: more writer work to interrupt
        while True:
            await asyncio.sleep(0.01)
            if not acked:
                continue
            keys = rng.sample(acked, min(4, len(acked)))
            bufs = [bytearray(parse_key(k).nbytes) for k in keys]  # type: ignore[union-attr]
            metas = await tier.get_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)])
            for k, m, b in zip(keys, metas, bufs):
                if m is None or bytes(b) != chunk_content(k):
                    emit(f"BAD {k.hex()}")

    await asyncio.gather(*(writer() for _ in range(args.writers)), reader())


async def _compact_churn(args: argparse.Namespace) -> None:
    tier = await _open_ready(args, segment_threshold_bytes=8192, segment_max_bytes=1 << 20)
    rng = random.Random(args.seed)
    scratch: List[List[bytes]] = []
    for batch in range(0, 1 << 30, 2):
        sizes = [rng.choice((30000, 65536, 131072)) for _ in range(rng.randint(1, 4))]
        keep, trash = make_batch(args.seed, batch, sizes), make_batch(args.seed, batch + 1, sizes)
        await tier.put_many(keep + trash)  # interleaved in one segment: deleting trash leaves it partly live
        emit(f"ack {batch} " + " ".join(k.hex() for k, _, _ in keep))
        scratch.append([k for k, _, _ in trash])
        if len(scratch) > 2:
            await tier.delete_many(scratch.pop(0))  # a whole batch: check_cache sees it complete or absent
        if batch % 4 == 0:
            report = await tier.compact_segments()
            if report.records:
                emit(f"compacted {report.records}")


def engine_request(seed: int, index: int) -> Tuple[List[int], int]:
    """Tokens of engine request ``index`` and the seed of its block contents."""
    rng = random.Random(seed * 1_000_003 + index)
    n = 16 * rng.randint(2, 6)
    return [rng.randrange(32000) for _ in range(n)], rng.randrange(1 << 62)


def engine_layout():
    from kvtier.policy import AttentionGroup, ModelLayout

    return ModelLayout(groups=(AttentionGroup(16),))


def _engine_device(layout: ModelLayout, num_blocks: int) -> DeviceKVView:
    """The fault suite's CPU device over ``layout`` (``engine_layout()``): 4 KiB per block and layer."""
    from kvtier.tools.testing.scenario import make_cpu_device

    return make_cpu_device(layout, num_blocks=num_blocks, num_layers=2, kv_heads=2, head_dim=16)


def fill_blocks(device, table: Sequence[int], content_seed: int) -> None:
    """Fill the request's device blocks (group 0, every layer) with bytes derived from its seed."""
    import torch

    gen = torch.Generator().manual_seed(content_seed)
    for layer in device._groups[0].layers:
        for block in table:
            raw = layer[block].view(torch.uint8).view(-1)
            raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))


async def _engine_spill(args: argparse.Namespace) -> None:
    from kvtier.engine import EngineConfig, OffloadEngine

    layout = engine_layout()
    device = _engine_device(layout, 512)
    config = EngineConfig(
        cache_dir=args.dir,
        host_capacity_bytes=4 << 20,
        lmdb_map_size_bytes=args.map_size_bytes,
        pressure_poll_interval_s=3600.0,
        spill_batch_max_chunks=16,
    )
    async with OffloadEngine(layout, device, config, fingerprint=ENGINE_FINGERPRINT, pressure_sources={}) as engine:
        emit("ready")
        counter = iter(range(1 << 30))

        async def producer(lane: int) -> None:
            blocks = list(range(1 + lane * 8, 1 + lane * 8 + 8))
            while True:
                index = next(counter)
                tokens, content_seed = engine_request(args.seed, index)
                table = blocks[: len(tokens) // 16]
                fill_blocks(device, table, content_seed)
                handle = engine.store(tokens, [table])
                result = await handle
                if result.durable and not result.dropped:
                    emit(f"ack {index}")
                await asyncio.sleep(args.pause_s)

        await asyncio.gather(*(producer(lane) for lane in range(args.writers)))


def _hold_reader(args: argparse.Namespace) -> None:
    import lmdb

    env = lmdb.open(args.dir, readonly=True, lock=True, max_dbs=4, subdir=True)
    txn = env.begin()
    chunks = env.open_db(b"chunks", txn=txn, create=False)
    n = txn.stat(chunks)["entries"]
    emit(f"holding {os.getpid()} {n}")
    time.sleep(3600)


async def _warmup_writer(args: argparse.Namespace) -> None:
    from kvtier.tiers.lmdb import LmdbTier

    rng = random.Random(args.seed)
    async with await LmdbTier.open(args.dir, map_size_bytes=args.map_size_bytes, reader_check_interval_s=0.2,
                                   segment_threshold_bytes=args.segment_threshold_bytes,
                                   segment_max_bytes=args.segment_max_bytes) as tier:
        emit("ready")
        deadline = time.monotonic() + args.duration_s
        batch = 0
        written = 0
        live: Dict[int, List[bytes]] = {}
        while time.monotonic() < deadline:
            sizes = [rng.choice((4096, 30000, 65536)) for _ in range(rng.randint(1, 6))]
            items = make_batch(args.seed, batch, sizes)
            await tier.put_many(items)
            written += sum(sizes)
            live[batch] = [k for k, _, _ in items]
            emit(f"ack {batch} " + " ".join(k.hex() for k, _, _ in items))
            old = batch - args.window
            if old in live:
                await tier.delete_many(live.pop(old))
                emit(f"del {old}")
            batch += 1
            await asyncio.sleep(args.pause_s)
        stats = tier.statistics()
        emit("done " + json.dumps({"batches": batch, "written_bytes": written, "errors": stats.errors,
                                     "map_growths": stats.extra["map_growths"]}))


# ------------------------------------------------------------------------------------ spawn


def spawn_reader(path: str, keys_hex: Sequence[str], readonly: bool = True) -> None:
    """A ``multiprocessing`` spawn target: open the tier at ``path`` in this fresh process and read
    ``keys_hex`` back; exits 0 when each holds ``chunk_content(key)``, 3 when not, 4 on a kvtier
    error."""

    async def main() -> int:
        from kvtier.tiers.lmdb import LmdbTier

        async with await LmdbTier.open(path, readonly=readonly) as tier:
            keys = [bytes.fromhex(k) for k in keys_hex]
            bufs = [bytearray(parse_key(k).nbytes) for k in keys]  # type: ignore[union-attr]
            metas = await tier.get_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)])
            ok = all(m is not None and bytes(b) == chunk_content(k) for k, m, b in zip(keys, metas, bufs))
            return 0 if ok else 3

    try:
        code = asyncio.run(main())
    except KvtierError:
        code = 4
    sys.exit(code)


# ------------------------------------------------------------------------------- parent side


@dataclass
class KillResult:
    """One kill -9 iteration: what the child acknowledged and what the reopened cache holds."""

    mode: str
    seed: int
    delay_s: float
    acked_batches: int = 0
    acked: List[bytes] = field(default_factory=list)  # chunk keys (tier) or b"<request index>" (engine)
    check: Optional[CacheCheck] = None
    problems: List[str] = field(default_factory=list)
    data_bytes: int = 0
    compacted: int = 0  # records the child said its compact_segments calls moved (mode "compact")


def kill_during_spill(
    directory: Path,
    seed: int,
    delay_s: float,
    *,
    mode: str = "tier",
    earlier_acked: Sequence[bytes] = (),
    ready_timeout_s: float = 60.0,
    child_args: Sequence[str] = (),
) -> KillResult:
    """Start a ``spill`` (``mode="tier"``), ``compact-churn`` (``"compact"``) or ``engine-spill`` (``"engine"``) child on
    ``directory``, SIGKILL it ``delay_s`` after it said ``ready``, then reopen the directory here
    and check it (blocking). ``earlier_acked``: keys acknowledged by earlier children on the same
    directory, which must still be there too. ``child_args``: more options for the child."""
    command = {"tier": "spill", "engine": "engine-spill", "compact": "compact-churn"}[mode]
    result = KillResult(mode, seed, delay_s)
    err_path = directory.with_name(directory.name + f".stderr-{seed}")
    proc = run_child([command, "--dir", str(directory), "--seed", str(seed), *child_args], err_path)
    try:
        first = read_line(proc, ready_timeout_s)
        if first != "ready":
            result.problems.append(f"child said {first!r} instead of ready")
        time.sleep(delay_s)
    finally:
        proc.kill()
        out = proc.stdout.read() if proc.stdout is not None else b""
        proc.wait()
    stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
    err_path.unlink(missing_ok=True)
    if proc.returncode != -9:
        result.problems.append(f"child ended with {proc.returncode} before the kill: {stderr[-2000:]}")
    lines = out.decode().split("\n")
    complete = lines[:-1]  # the last element is "" or a line cut by the kill (never parsed)
    for line in complete:
        parts = line.split()
        if parts and parts[0] == "ack":
            result.acked_batches += 1
            if mode == "engine":
                result.acked.append(parts[1].encode())
            else:
                result.acked.extend(bytes.fromhex(k) for k in parts[2:])
        elif parts and parts[0] == "compacted":
            result.compacted += int(parts[1])
        elif parts and parts[0] == "BAD":
            result.problems.append(f"the child read back wrong bytes: {line}")
    data = directory / "data.mdb"
    result.data_bytes = data.stat().st_size if data.exists() else 0
    if mode != "engine":
        result.check = check_cache(str(directory), list(earlier_acked) + result.acked)
        result.problems.extend(result.check.problems)
    else:
        indices = [int(a) for a in result.acked]
        result.problems.extend(asyncio.run(check_engine_requests(str(directory), seed, indices)))
    return result


def run_kill_chains(
    root: Path,
    iterations: int,
    *,
    mode: str,
    base_seed: int,
    chain: int = 2,
    lanes: int = 2,
    child_args: Sequence[str] = (),
) -> List[KillResult]:
    """Run ``iterations`` kill -9 iterations, ``chain`` per directory under ``root`` (each child
    after the first starts on what the previous one's death left, and everything acknowledged on
    that directory so far must survive), ``lanes`` chains side by side. Delays are uniform in
    0.2-2 s, seeded by ``base_seed``."""
    from concurrent.futures import ThreadPoolExecutor

    chains = [list(range(start, min(iterations, start + chain))) for start in range(0, iterations, chain)]

    def run_chain(members: List[int]) -> List[KillResult]:
        directory = root / f"chain-{members[0]}"
        acked: List[bytes] = []
        out = []
        for i in members:
            rng = random.Random(base_seed * 7919 + i)
            result = kill_during_spill(
                directory, base_seed + i, rng.uniform(0.2, 2.0), mode=mode, earlier_acked=acked, child_args=child_args
            )
            acked.extend(result.acked)
            out.append(result)
        return out

    with ThreadPoolExecutor(max_workers=lanes) as pool:
        return [r for members in pool.map(run_chain, chains) for r in members]


def summarize_kills(results: Sequence[KillResult]) -> str:
    head = (
        f"{len(results)} kill -9 iterations ({results[0].mode}), delays "
        f"{min(r.delay_s for r in results):.2f}-{max(r.delay_s for r in results):.2f} s, "
    )
    if results[0].mode == "engine":
        return head + (
            f"{sum(r.acked_batches for r in results)} requests acknowledged durable, each a full hit "
            f"that loaded bitwise after the restart"
        )
    records = sum(r.check.records for r in results if r.check is not None)
    batches = sum(r.check.batches for r in results if r.check is not None)
    moved = f"; {sum(r.compacted for r in results)} records moved by the children's compact_segments calls"
    return head + (
        f"{sum(r.acked_batches for r in results)} acknowledged batches / {sum(len(r.acked) for r in results)} "
        f"acknowledged chunks, all found intact; {records} records in {batches} batches (every one whole) "
        f"verified after the kills"
    ) + (moved if results[0].mode == "compact" else "")


async def check_engine_requests(directory: str, seed: int, indices: Sequence[int]) -> List[str]:
    """Restart an engine over ``directory`` and load every acknowledged request of an
    ``engine-spill`` child with that seed: a full hit whose blocks equal the bytes the child put on
    its device. Returns the problems found (empty: nothing acknowledged was lost or changed)."""
    from kvtier.engine import EngineConfig, OffloadEngine

    layout = engine_layout()
    device = _engine_device(layout, 8)
    expected_device = _engine_device(layout, 8)
    config = EngineConfig(cache_dir=directory, host_capacity_bytes=4 << 20, pressure_poll_interval_s=3600.0,
                          quarantine_corrupt_cache_dir=False)
    problems: List[str] = []
    async with OffloadEngine(layout, device, config, fingerprint=ENGINE_FINGERPRINT, pressure_sources={}) as engine:
        for index in indices:
            tokens, content_seed = engine_request(seed, index)
            n = len(tokens) // 16
            table = list(range(1, 1 + n))
            fill_blocks(expected_device, table, content_seed)
            for layer in device._groups[0].layers:
                layer[1 : 1 + n].zero_()
            hit = engine.lookup(tokens + [0])
            if hit != len(tokens):
                problems.append(f"request {index}: acknowledged, but the hit is {hit} of {len(tokens)} tokens")
                continue
            result = await engine.load(tokens + [0], hit, [table + [0]])
            if not result.ok:
                problems.append(f"request {index}: load failed: {result.reason}")
                continue
            for got, want in zip(device._groups[0].layers, expected_device._groups[0].layers):
                if got[1 : 1 + n].numpy().tobytes() != want[1 : 1 + n].numpy().tobytes():
                    problems.append(f"request {index}: loaded bytes differ")
                    break
        await engine.flush()
        engine.check()
    return problems


# ------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.testing.fault_child")
    sub = parser.add_subparsers(dest="command", required=True)

    def writer(name: str) -> argparse.ArgumentParser:
        """A command that writes chunks into ``--dir`` (seeded by ``--seed``, LMDB map ``--map-size-bytes``)."""
        command = sub.add_parser(name)
        command.add_argument("--dir", required=True)
        command.add_argument("--seed", type=int, required=True)
        command.add_argument("--map-size-bytes", type=int, default=1 << 20)
        return command

    spill = writer("spill")
    spill.add_argument("--writers", type=int, default=3)
    spill.add_argument("--max-batch", type=int, default=6)
    spill.add_argument("--segment-threshold-bytes", type=int, default=0, help="0: every record inline")
    engine = writer("engine-spill")
    engine.add_argument("--writers", type=int, default=2)
    engine.add_argument("--pause-s", type=float, default=0.01)
    writer("compact-churn")
    hold = sub.add_parser("hold-reader")
    hold.add_argument("--dir", required=True)
    warm = writer("warmup-writer")
    warm.add_argument("--duration-s", type=float, default=3.0)
    warm.add_argument("--window", type=int, default=8)
    warm.add_argument("--pause-s", type=float, default=0.0)
    warm.add_argument("--segment-threshold-bytes", type=int, default=0, help="0: every record inline")
    warm.add_argument("--segment-max-bytes", type=int, default=1 << 20)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    commands = {"spill": _spill, "engine-spill": _engine_spill, "compact-churn": _compact_churn,
                "hold-reader": _hold_reader, "warmup-writer": _warmup_writer}
    return run_command(commands, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
