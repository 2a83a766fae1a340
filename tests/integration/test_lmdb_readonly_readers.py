"""A read-only open beside a writer in another process never returns bytes no put wrote.

LMDB keeps a page a reader uses from being reused only while that reader is in the reader table of
``lock.mdb``. A read-only open of a directory without one used to go without LMDB's lock: a writer
opening the directory later reused the pages those reads still used. Now a read-only open creates
the lock file when it can (its reads keep their snapshot, exactly), and where it cannot (a
read-only mount) copies each record -- or, for a record in a segment file, its pointer -- out of the
map before checking it (a read is then the bytes of one put, or a miss).

Each reader pauses inside its read transaction (an ``IOHook``: the tier calls it once the
transaction is open) while a writer in another OS process rewrites the same keys, so the pages the
reader's snapshot names are freed and reused while it still holds them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvtier.errors import TierIOError
from kvtier.tiers.base import ChunkMeta, IOHook
from kvtier.tiers.lmdb import LmdbTier
from mounts import bind_mount, tmpfs

RECORD_BYTES = 256 << 10  # several overflow pages per record
KEYS = [b"reader-key-%d" % i for i in range(4)]


def value(key_index: int, generation: int, nbytes: int = RECORD_BYTES) -> bytes:
    """What put number ``generation`` wrote under ``KEYS[key_index]``: its own 8-byte tag, repeated."""
    tag = (generation * len(KEYS) + key_index).to_bytes(8, "little")
    return tag * (nbytes // 8)


def meta(key_index: int, nbytes: int = RECORD_BYTES) -> ChunkMeta:
    return ChunkMeta(b"readers", 0, key_index, "uint8", (nbytes,))


# Rewrites every key, one commit per generation, from --first for --count generations (or, with
# --seconds, until that much time has passed), inline records, raw codec: what value() says.
_WRITER = textwrap.dedent(
    """
    import argparse, asyncio, time
    import numpy as np
    from kvtier.tiers.lmdb import LmdbTier
    from kvtier.tiers.record_format import CodecConfig
    from test_lmdb_readonly_readers import KEYS, RECORD_BYTES, meta, value

    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--keys", type=int, default=len(KEYS))
    parser.add_argument("--record-bytes", type=int, default=RECORD_BYTES)
    parser.add_argument("--segment-threshold-bytes", type=int, default=0)  # 0: every record inside LMDB
    parser.add_argument("--pause-s", type=float, default=0.0)  # between generations
    args = parser.parse_args()

    async def main():
        async with await LmdbTier.open(args.path, map_size_bytes=256 << 20,
                                       segment_threshold_bytes=args.segment_threshold_bytes or None,
                                       codec=CodecConfig(compress=False)) as tier:
            generation, deadline = args.first, time.monotonic() + args.seconds
            while generation < args.first + args.count or time.monotonic() < deadline:
                n = args.record_bytes
                await tier.put_many([(key, meta(i, n), np.frombuffer(value(i, generation, n), np.uint8))
                                     for i, key in enumerate(KEYS[:args.keys])])
                generation += 1
                await asyncio.sleep(args.pause_s)
            print(generation - args.first, flush=True)

    asyncio.run(main())
    """
)


def run_writer(path: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(writer: subprocess.Popen) -> int:
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, f"the writer failed ({writer.returncode}): {err[-2000:]}"
    return int(out.split()[-1])


class PauseInRead(IOHook):
    """Holds every read transaction open: the first until ``release`` is set, the others ``hold_s``."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold_s = hold_s

    def before(self, op: str) -> None:
        if op != "read":
            return
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60), "the test never let the read go on"
        elif self.hold_s:
            time.sleep(self.hold_s)


def fill(path: Path, *args: str) -> None:
    writer = run_writer(path, "--first", "0", "--count", "1", *args)
    assert finish(writer) == 1
    os.unlink(path / "lock.mdb")  # as a copied (or restored) directory: data.mdb alone


async def read_all(tier: LmdbTier, keys: int = len(KEYS), nbytes: int = RECORD_BYTES):
    bufs = [bytearray(nbytes) for _ in KEYS[:keys]]
    metas = await tier.get_many_into([(key, memoryview(b)) for key, b in zip(KEYS, bufs)])
    return metas, [bytes(b) for b in bufs]


@pytest.mark.asyncio
async def test_a_read_only_open_keeps_its_snapshot_while_a_later_writer_rewrites_every_record(tmp_path):
    cache = tmp_path / "cache"
    fill(cache)
    async with await LmdbTier.open(cache, readonly=True, map_size_bytes=64 << 20, read_workers=1) as reader:
        assert (cache / "lock.mdb").exists()  # made by the read-only open: its reads are in its reader table
        pause = PauseInRead()
        reader._io_hook = pause
        reading = asyncio.create_task(read_all(reader))
        assert await asyncio.to_thread(pause.entered.wait, 30)
        # Opened after the reader: 30 commits rewriting every record, each one freeing the last's pages.
        assert finish(await asyncio.to_thread(run_writer, cache, "--first", "1", "--count", "30")) == 30
        pause.release.set()
        metas, got = await reading
        # Exactly what the reader's transaction saw when it began: generation 0, every byte.
        assert metas == [meta(i) for i in range(len(KEYS))]
        assert got == [value(i, 0) for i in range(len(KEYS))]
        reader._io_hook = IOHook()
        metas, got = await read_all(reader)  # a new transaction sees the writer's last commit
        assert got == [value(i, 30) for i in range(len(KEYS))]


def put_by(key_index: int, data: bytes) -> int:
    """The generation whose put wrote ``data`` under ``KEYS[key_index]`` (-1: no put wrote it)."""
    n = int.from_bytes(data[:8], "little")
    generation, index = divmod(n, len(KEYS))
    return generation if index == key_index and data == value(key_index, generation, len(data)) else -1


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["inline", "segments"])
async def test_a_read_only_mount_reads_only_bytes_a_put_wrote_while_a_writer_rewrites_them(tmp_path, store):
    # The writer on tmpfs: its commits never wait for a disk, so it rewrites pages all the time.
    with tmpfs(tmp_path / "fast", "size=512m,mode=0700") as fast:
        source = fast / "source"
        # Segment files are append-only: the writer goes slower there, or its rewrites fill the tmpfs.
        where = ("--segment-threshold-bytes", str(8 << 10), "--pause-s", "0.03") if store == "segments" else ()
        fill(source, *where)
        writer = run_writer(source, "--first", "1", "--seconds", "6", *where)
        try:
            while not (source / "lock.mdb").exists():  # the writer's: on the read-only mount it cannot be written
                await asyncio.sleep(0.01)
            with bind_mount(source, tmp_path / "ro", read_only=True) as ro:
                async with await LmdbTier.open(ro, readonly=True, map_size_bytes=64 << 20,
                                               read_workers=len(KEYS)) as reader:
                    assert reader._db.lockless  # no reader table for this open
                    # the records are where the case says (pointers to segment files, or inline)
                    assert {info.segment is not None for info in reader.iter_records()} == {store == "segments"}
                    # Each transaction stays open a while: its snapshot goes stale, its pages are reused.
                    reader._io_hook = PauseInRead(hold_s=0.01)
                    reader._io_hook.entered.set()  # no first-read wait
                    reads = hits = failed = 0
                    wrong = []
                    started = time.monotonic()
                    while writer.poll() is None and time.monotonic() - started < 8:
                        try:
                            metas, got = await read_all(reader)  # one key per read thread
                        except TierIOError:  # LMDB met a reused page as one of its own: typed, no bytes
                            failed += 1
                            continue
                        for i, (m, data) in enumerate(zip(metas, got)):
                            reads += 1
                            if m is not None:
                                hits += 1
                                if put_by(i, data) < 0:
                                    wrong.append((i, data[:16].hex()))
        finally:
            generations = finish(writer)
    print(f"read-only mount beside a writer ({store}): {generations} generations written, {reads} reads, {hits} hits, "
          f"{failed} batches failed typed, {len(wrong)} wrong")
    assert generations > 10 and reads > 100 and hits > reads // 2
    assert wrong == []
