"""Journaled child processes that share one cache directory, and the journal they write.

Run as ``python -m kvtier.tools.testing.cache_dir_child COMMAND ...``. Commands:

- ``writer``: an ``LmdbTier`` writer (a serving process's disk tier, or a warmup) that stores
  batches of fault-suite chunks (``children.make_batch``: bytes are a function of the key, and
  keys spell the writer's seed, so no two writers and no two lives of one writer share a key) and
  deletes the batch ``--window`` batches back (reading it back first), for ``--duration-s`` seconds
  or until killed. A reader coroutine reads acknowledged chunks back all the time. ``--fail-at N``
  fails the Nth commit of the tier with an injected I/O error (``faults.IOFaultPlan``).
- ``gc``: ``tools._maintenance.gc_cache`` (what ``kvtier gc`` runs: LRU eviction down to
  ``--max-bytes``, then compaction), with every record it evicts journaled.
- ``reopen``: open the directory writable and close it again, in a loop for ``--duration-s`` (a
  server restarting over and over; every writable open reclaims what crashed writers left).
- ``read-check``: a read-only tier reading listed chunks for ``--duration-s``; every hit must be
  ``chunk_content(key)``.

The journal is one append-only file per process, one line per event, each written with one
``os.write`` and fsync'd before the child goes on, so that after a kill -9 it says exactly what was
acknowledged. A cut last line (no newline) is ignored by ``read_journal``. Lines:

``try <batch> <key hex>...``   a put is about to be made (in flight: its keys may or may not land)
``ack <sequence> <batch>``     that put returned (durable), with the sequence the tier gave it
``fail <batch> <error>``       that put raised (a typed kvtier error)
``del <batch>``                a delete of the whole batch is about to be made
``gone <sequence> <batch>``    it returned; from here on no read or lookup may find those keys
``delfail <batch> <error>``    it raised (the keys may or may not be gone)
``rm <sequence> <reason> <key hex>``  the tier's removal feed reported the key removed
``BAD <key hex>``              a read returned bytes no put wrote
``MISS <key hex>``             a read missed an acknowledged chunk not deleted by this writer
``ADMIT <key hex>``            a lookup (``contains_many``) found a key after its ``gone``
``UNTYPED <text>``             a put raised something else than a kvtier error
``done <json>``                clean end, with counters
"""

from __future__ import annotations

import argparse
import asyncio
import errno as errno_codes
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

from kvtier.errors import KvtierError

from .children import chunk_content, make_batch, parse_key, run_command

__all__ = ["Journal", "JournalEntries", "read_journal", "main"]

# Chunk lengths the writers draw from: 4 KiB stays inline in LMDB, the rest go to segment files
# (threshold 8 KiB), 200000 bytes is not a multiple of a page.
SIZES = (4096, 30000, 65536, 131072, 200000)


class Journal:
    """An append-only journal file: ``write(line)`` returns once the line is on disk."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, line: str) -> None:
        os.write(self._fd, (line + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class JournalEntries:
    """One journal, parsed: what its process tried, acknowledged, deleted, saw removed and found
    wrong. Keys are bytes; sequences are the tier's."""

    tried: Dict[bytes, int] = field(default_factory=dict)  # key -> batch
    batches: Dict[int, List[bytes]] = field(default_factory=dict)
    acked: Dict[bytes, int] = field(default_factory=dict)  # key -> sequence of its put
    failed: Set[int] = field(default_factory=set)  # batches whose put raised
    deleting: Set[bytes] = field(default_factory=set)  # a delete was started (may or may not have landed)
    failed_deletes: Set[int] = field(default_factory=set)
    gone: Dict[bytes, int] = field(default_factory=dict)  # key -> sequence of its delete
    removed: Dict[bytes, List[tuple]] = field(default_factory=dict)  # key -> [(sequence, reason)]
    bad: List[bytes] = field(default_factory=list)
    missed: List[bytes] = field(default_factory=list)
    admitted: List[bytes] = field(default_factory=list)
    untyped: List[str] = field(default_factory=list)
    done: Optional[Dict[str, float]] = None


def read_journal(path: Path) -> JournalEntries:
    """Parse a journal (complete lines only: a line a kill cut short is not one)."""
    out = JournalEntries()
    if not path.exists():
        return out
    text = path.read_bytes().decode(errors="replace")
    for line in text.split("\n")[:-1]:
        word, *rest = line.split()
        if word == "try":
            batch = int(rest[0])
            keys = [bytes.fromhex(k) for k in rest[1:]]
            out.batches[batch] = keys
            for key in keys:
                out.tried[key] = batch
        elif word == "ack":
            for key in out.batches[int(rest[1])]:
                out.acked[key] = int(rest[0])
        elif word == "fail":
            out.failed.add(int(rest[0]))
        elif word == "del":
            out.deleting.update(out.batches[int(rest[0])])
        elif word == "gone":
            for key in out.batches[int(rest[1])]:
                out.gone[key] = int(rest[0])
        elif word == "delfail":
            out.failed_deletes.add(int(rest[0]))
        elif word == "rm":
            out.removed.setdefault(bytes.fromhex(rest[2]), []).append((int(rest[0]), rest[1]))
        elif word == "BAD":
            out.bad.append(bytes.fromhex(rest[0]))
        elif word == "MISS":
            out.missed.append(bytes.fromhex(rest[0]))
        elif word == "ADMIT":
            out.admitted.append(bytes.fromhex(rest[0]))
        elif word == "UNTYPED":
            out.untyped.append(line)
        elif word == "done":
            out.done = json.loads(line.partition(" ")[2])
    return out


def _journal_removals(journal: Journal):
    def on_removed(removals) -> None:
        for r in removals:
            journal.write(f"rm {r.sequence} {r.reason} {bytes(r.key).hex()}")

    return on_removed


async def _read_back(tier, keys: Sequence[bytes]) -> List[Optional[bool]]:
    """Per key: True (its bytes), False (other bytes: a read no put wrote), None (a miss)."""
    bufs = [bytearray(parse_key(k).nbytes) for k in keys]  # type: ignore[union-attr]
    metas = await tier.get_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)])
    return [None if m is None else bytes(b) == chunk_content(k) for k, m, b in zip(keys, metas, bufs)]


async def _writer(args: argparse.Namespace) -> None:
    from kvtier.tiers.lmdb import LmdbTier

    from .faults import IOFaultPlan, inject_io_faults

    journal = Journal(args.journal)
    tier = await LmdbTier.open(args.dir, map_size_bytes=1 << 20, reader_check_interval_s=0.2,
                               access_flush_interval_s=0.1, segment_threshold_bytes=8192,
                               segment_max_bytes=1 << 20)
    tier.subscribe_removals(_journal_removals(journal))
    if args.fail_at:
        # a commit: what LMDB itself raises there (EIO, or ENOSPC as lmdb.DiskError)
        inject_io_faults(tier, IOFaultPlan(fail_at=args.fail_at, ops=("commit",),
                                           errno=errno_codes.ENOSPC if args.enospc else errno_codes.EIO))
    print("ready", flush=True)
    rng = random.Random(args.seed)
    live: Dict[int, List[bytes]] = {}  # acknowledged, not being deleted: what the reader may expect
    deleting: Set[bytes] = set()
    counts = {"batches": 0, "acked": 0, "failed": 0, "deleted": 0, "reads": 0, "hits": 0}
    deadline = time.monotonic() + args.duration_s if args.duration_s > 0 else float("inf")
    stop = asyncio.Event()

    async def write() -> None:
        batch = 0
        while time.monotonic() < deadline:
            items = make_batch(args.seed, batch, [rng.choice(SIZES) for _ in range(rng.randint(1, 6))])
            keys = [k for k, _, _ in items]
            journal.write(f"try {batch} " + " ".join(k.hex() for k in keys))
            try:
                sequence = await tier.put_many(items)
            except Exception as exc:  # noqa: BLE001 - journaled; anything but a kvtier error is a defect
                journal.write(f"fail {batch} {type(exc).__name__}")
                if not isinstance(exc, KvtierError):
                    journal.write(f"UNTYPED put_many raised {type(exc).__name__}: {exc}".replace("\n", " "))
                counts["failed"] += 1
            else:
                journal.write(f"ack {sequence} {batch}")
                counts["acked"] += len(keys)
                live[batch] = keys
            old = batch - args.window
            if old in live:
                # every acknowledged record is read back once more before its delete
                await check(live[old])
                doomed = live.pop(old)
                deleting.update(doomed)
                journal.write(f"del {old}")
                try:
                    await tier.delete_many(doomed)
                except KvtierError as exc:  # an injected fault: the keys may or may not be gone
                    journal.write(f"delfail {old} {type(exc).__name__}")
                else:
                    journal.write(f"gone {tier.sequence} {old}")
                    counts["deleted"] += len(doomed)
                    for key, present in zip(doomed, await tier.contains_many(doomed)):
                        if present:
                            journal.write(f"ADMIT {key.hex()}")
            batch += 1
            counts["batches"] = batch
            await asyncio.sleep(args.pause_s)
        stop.set()

    async def check(keys: List[bytes]) -> None:
        try:
            outcomes = await _read_back(tier, keys)
        except KvtierError:
            return  # a typed read failure, not a wrong byte
        for key, ok in zip(keys, outcomes):
            counts["reads"] += 1
            if ok is False:
                journal.write(f"BAD {key.hex()}")
            elif ok is None and key not in deleting:
                journal.write(f"MISS {key.hex()}")
            elif ok:
                counts["hits"] += 1

    async def read() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.005)
            pool = [k for keys in live.values() for k in keys]
            if pool:
                await check(rng.sample(pool, min(4, len(pool))))

    await asyncio.gather(write(), read())
    stats = tier.statistics().as_dict()
    await tier.close()
    journal.write("done " + json.dumps(dict(counts, errors=stats["errors"], quarantined=stats["quarantined"])))
    journal.close()


def _gc(args: argparse.Namespace) -> None:
    from kvtier.tools._maintenance import gc_cache

    journal = Journal(args.journal)
    report = gc_cache(args.dir, args.max_bytes, on_removed=_journal_removals(journal))
    journal.write("done " + json.dumps(report))
    journal.close()


def _reopen(args: argparse.Namespace) -> None:
    from kvtier.tiers.lmdb import LmdbTier

    opens = 0
    deadline = time.monotonic() + args.duration_s
    while time.monotonic() < deadline:
        LmdbTier(args.dir, map_size_bytes=1 << 20, segment_threshold_bytes=8192,
                 segment_max_bytes=1 << 20).close_sync()
        opens += 1
    print("done " + json.dumps({"opens": opens}), flush=True)


async def _read_check(args: argparse.Namespace) -> None:
    from kvtier.tiers.lmdb import LmdbTier

    rng = random.Random(args.seed)
    reads = hits = bad = 0
    deadline = time.monotonic() + args.duration_s
    async with await LmdbTier.open(args.dir, readonly=True) as tier:
        print("ready", flush=True)
        while time.monotonic() < deadline:
            keys = [k for k in await tier.list_keys() if parse_key(k) is not None]  # the engine's are not ours
            sample = rng.sample(keys, min(16, len(keys)))
            for key, ok in zip(sample, await _read_back(tier, sample)):
                reads += 1
                hits += ok is True
                if ok is False:
                    bad += 1
                    print(f"BAD {key.hex()}", flush=True)
            await asyncio.sleep(0.01)
    print("done " + json.dumps({"reads": reads, "hits": hits, "bad": bad}), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.testing.cache_dir_child")
    sub = parser.add_subparsers(dest="command", required=True)
    writer = sub.add_parser("writer")
    writer.add_argument("--dir", required=True)
    writer.add_argument("--journal", required=True)
    writer.add_argument("--seed", type=int, required=True)
    writer.add_argument("--duration-s", type=float, default=0.0, help="0: until killed")
    writer.add_argument("--window", type=int, default=8)
    writer.add_argument("--pause-s", type=float, default=0.002)
    writer.add_argument("--fail-at", type=int, default=0, help="0: no injected fault")
    writer.add_argument("--enospc", action="store_true", help="the injected fault is a full disk, not EIO")
    gc = sub.add_parser("gc")
    gc.add_argument("--dir", required=True)
    gc.add_argument("--journal", required=True)
    gc.add_argument("--max-bytes", type=int, required=True)
    reopen = sub.add_parser("reopen")
    reopen.add_argument("--dir", required=True)
    reopen.add_argument("--duration-s", type=float, default=1.0)
    check = sub.add_parser("read-check")
    check.add_argument("--dir", required=True)
    check.add_argument("--seed", type=int, required=True)
    check.add_argument("--duration-s", type=float, default=1.0)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    commands = {"writer": _writer, "gc": _gc, "reopen": _reopen, "read-check": _read_check}
    return run_command(commands, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
