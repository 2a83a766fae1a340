"""The corruption trials' child: ``python -m kvtier.tools.testing.corrupt_child corrupt-trials ...``.

Copies a pristine cache directory, flips bytes (in ``data.mdb``, and in its segment files when it
has some: ``flip_bytes``, pages told apart by ``lmdb_page_kinds``), and checks what every read, the
verifier and ``kvtier verify`` (the command itself, ``kvtier.tools.cli.main``) say; one JSON line
per trial (a crash names its trial). A child of its own because it drives the command line: the
other fault-suite children (``fault_child``) import no command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import shutil
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

from kvtier.errors import KvtierError

from .children import chunk_content, chunk_meta, emit, parse_key

if TYPE_CHECKING:
    from kvtier.tiers.lmdb import RecordInfo

__all__ = ["lmdb_page_kinds", "flip_bytes", "main"]


def lmdb_page_kinds(data: bytes, psize: int = 4096) -> List[str]:
    """Per page of a ``data.mdb`` image: "meta", "branch", "leaf", "overflow" (every page of a
    large value) or "free" (anything else: freed or never written)."""
    npages = len(data) // psize
    kinds = ["free"] * npages
    i = 0
    while i < npages:
        off = i * psize
        pgno, _pad, flags = struct.unpack_from("<QHH", data, off)
        if pgno == i and flags & 0x04:  # P_OVERFLOW: its page count follows the flags
            (count,) = struct.unpack_from("<I", data, off + 12)
            for j in range(i, min(npages, i + max(1, count))):
                kinds[j] = "overflow"
            i += max(1, count)
            continue
        if pgno == i and flags & 0x08:
            kinds[i] = "meta"
        elif pgno == i and flags & 0x01:
            kinds[i] = "branch"
        elif pgno == i and flags & 0x02:
            kinds[i] = "leaf"
        i += 1
    return kinds


def flip_bytes(path: Path, rng: random.Random, count: int, where: str, psize: int = 4096) -> List[int]:
    """XOR ``count`` bytes of the file with random non-zero masks; ``where`` picks the pages:
    "records" (overflow and leaf pages), "structure" (meta, branch and leaf pages) or "anywhere".
    Returns the offsets flipped."""
    data = bytearray(path.read_bytes())
    kinds = lmdb_page_kinds(bytes(data), psize)
    wanted = {"records": {"overflow", "leaf"}, "structure": {"meta", "branch", "leaf"}}.get(where)
    pages = [i for i, k in enumerate(kinds) if wanted is None or k in wanted] or list(range(len(kinds)))
    offsets = []
    for _ in range(count):
        page = rng.choice(pages)
        off = page * psize + rng.randrange(psize)
        data[off] ^= rng.randrange(1, 256)
        offsets.append(off)
    path.write_bytes(bytes(data))
    return offsets


async def _read_every_key(path: str, originals: Sequence[bytes]) -> Dict[str, object]:
    """Open read-write (reads quarantine what they find corrupt, as in a serving process) and read
    every original key and every listed one, one key per call so that a typed failure is local."""
    from kvtier.tiers.lmdb import LmdbTier

    counts = {"hits": 0, "misses": 0, "typed_read_errors": 0, "listed": 0}
    wrong: List[str] = []
    missed_keys: List[str] = []

    def report(opened: str) -> Dict[str, object]:
        return {"open": opened, "hits": counts["hits"], "misses": counts["misses"], "wrong": wrong,
                "typed_read_errors": counts["typed_read_errors"], "missed_keys": missed_keys,
                "listed": counts["listed"]}

    try:
        tier = await LmdbTier.open(path, map_size_bytes=1 << 20, verify_structure=True)
    except KvtierError as exc:
        return report(f"{type(exc).__name__}: {exc}")
    async with tier:
        try:
            # Both listings: list_keys (the engine's index) and the records themselves.
            listed = list(dict.fromkeys(await tier.list_keys() + [i.key for i in tier.iter_records()]))
        except KvtierError:
            listed = []
            counts["typed_read_errors"] = 1
        counts["listed"] = len(listed)
        candidates = list(dict.fromkeys(list(originals) + listed))
        for key in candidates:
            info = parse_key(key)
            size = info.nbytes if info is not None else None
            if size is None:
                # Not one of ours (a flipped key byte): size the buffer from its header if it parses.
                try:
                    matches: List[Optional[RecordInfo]] = [i for i in tier.iter_records() if i.key == key]
                    [rec] = matches or [None]
                except KvtierError:
                    rec = None
                size = rec.header.raw_length if rec is not None and rec.header is not None else 16
                size = min(size, 1 << 24)
            buf = bytearray(size)
            try:
                [meta] = await tier.get_many_into([(key, memoryview(buf))])
            except KvtierError:
                counts["typed_read_errors"] += 1
                continue
            if meta is None:
                counts["misses"] += 1
                if key in listed:
                    missed_keys.append(key.hex())
                continue
            if info is None or bytes(buf) != chunk_content(key) or meta != chunk_meta(key):
                wrong.append(key.hex())
            else:
                counts["hits"] += 1
    return report("ok")


def _corrupt_trials(args: argparse.Namespace) -> None:
    from kvtier.tools import cli
    from kvtier.tools._maintenance import verify_cache

    src = Path(args.src)
    originals = [bytes.fromhex(k) for k in Path(args.keys).read_text().split()]
    work = Path(args.work)
    # the cache's files but LMDB's lock file (a fresh one per trial): data.mdb and any segments
    files = sorted(p.name for p in src.iterdir() if p.is_file() and p.name != "lock.mdb")
    segment_files = [name for name in files if name.startswith("seg-") and name.endswith(".kvs")]
    wheres = ("records", "structure", "anywhere") + (("segments",) if segment_files else ())
    for trial in range(args.first, args.first + args.trials):
        rng = random.Random(args.seed * 100_003 + trial)
        where = wheres[trial % len(wheres)]
        count = rng.randint(1, args.max_flips)
        d = work / f"trial-{trial}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(mode=0o700, parents=True)
        for name in files:
            shutil.copyfile(src / name, d / name)
            os.chmod(d / name, 0o600)
        if where == "segments":  # anywhere in one segment file: payloads, headers, padding
            target = d / rng.choice(segment_files)
            offsets = flip_bytes(target, rng, count, "anywhere")
        else:
            offsets = flip_bytes(d / "data.mdb", rng, count, where)
        emit(f"start {trial} {where} {count}")
        result: Dict[str, object] = {"trial": trial, "where": where, "flips": count, "offsets": offsets}
        # 1. The verifier, read-only, before any read moves records.
        try:
            report = verify_cache(str(d), quarantine=False)
            result["verify"] = {"checked": report.checked, "ok": report.ok,
                                "bad": sorted(k.hex() for k, _ in report.corrupt)}
        except KvtierError as exc:
            result["verify"] = f"{type(exc).__name__}: {exc}"
        # 2. The command line says the same.
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = cli.main(["verify", "--cache-dir", str(d), "--no-quarantine", "--json"])
        result["cli"] = {"rc": rc, "out": stdout.getvalue().strip(), "err": stderr.getvalue().strip()}
        # 3. Every read: the original bytes or a miss.
        result["reads"] = asyncio.run(_read_every_key(str(d), originals))
        emit("result " + json.dumps(result))
        shutil.rmtree(d, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.testing.corrupt_child")
    sub = parser.add_subparsers(dest="command", required=True)
    trials = sub.add_parser("corrupt-trials")
    trials.add_argument("--src", required=True)
    trials.add_argument("--keys", required=True, help="file of the pristine keys, hex, whitespace-separated")
    trials.add_argument("--work", required=True)
    trials.add_argument("--seed", type=int, required=True)
    trials.add_argument("--first", type=int, default=0)
    trials.add_argument("--trials", type=int, default=30)
    trials.add_argument("--max-flips", type=int, default=24)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _corrupt_trials(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
