"""Segment files beside other processes and failures (tiers/lmdb/segments.py): a writable open (a
restart, ``kvtier verify``, ``kvtier gc``) beside a live writer keeps every record it acknowledged;
segment names never repeat and a cached read fd never serves another file; a new segment is used
only once its name is synced; an empty index beside segment files is damage, nothing deleted;
deleted segments give their space back and read fds stay bounded; a file that cannot be deleted
after a commit fails nothing. The interleavings across processes are chosen by the test (a child
driven step by step, locks observed in /proc/locks), never left to timing."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from kvtier.errors import CorruptCacheError, CorruptRecordError, TierIOError
from kvtier.tiers.base import Removal
from kvtier.tiers.lmdb import LmdbTier, quarantine_cache_dir
from kvtier.tiers.lmdb import segments
from kvtier.tiers.lmdb.segment_reader import SegmentReader
from kvtier.tiers.lmdb.segment_files import held_by_writer
from kvtier.tiers.lmdb.segments import SegmentWriter, committed_ends
from kvtier.tiers.record_format import CodecConfig
from kvtier.tools.cli import main
from kvtier.tools.testing.children import make_batch
from segment_checks import assert_ledger_matches, assert_served, pointers, segment_files

THRESHOLD = 16 << 10
RAW = CodecConfig(compress=False)
CHILD = Path(__file__).with_name("segment_child.py")
# 4 records of this size fill a 1 MiB segment past its end, so the next batch starts a new one
RECORD = 300_000
WAIT_S = 10.0


class Child:
    """A second process with the tier open (``segment_child.py``), one step per call."""

    def __init__(self, path: Path, **kwargs: object) -> None:
        self.proc = subprocess.Popen([sys.executable, str(CHILD), str(path), json.dumps(kwargs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()

    def _answer(self) -> Dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the child died (exit {self.proc.wait(30)})"
        answer = json.loads(line)
        assert answer["ok"]
        return answer

    def send(self, **command: object) -> Dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.send(op="close")
        assert self.proc.wait(60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _wait_until_blocked_on(pid: int, lock_file: Path, proc: subprocess.Popen) -> None:
    """Until process ``pid`` waits for a ``flock`` of ``lock_file`` (a ``->`` line of /proc/locks)."""
    inode = os.stat(lock_file).st_ino
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the opener exited ({proc.returncode}) instead of waiting for {lock_file}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "->" in parts and "FLOCK" in parts and str(pid) in parts and parts[-3].endswith(f":{inode}"):
                    return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never waited for {lock_file}")


_OPENERS = {
    "restart": lambda path: [sys.executable, "-c",
                             "import sys; from kvtier.tiers.lmdb import LmdbTier; LmdbTier(sys.argv[1]).close_sync()", str(path)],
    "verify": lambda path: [sys.executable, "-m", "kvtier.tools.cli", "verify", "--cache-dir", str(path)],
    "gc": lambda path: [sys.executable, "-m", "kvtier.tools.cli", "gc", "--cache-dir", str(path), "--max-bytes", "1GiB"],
}


@pytest.mark.parametrize("opener", sorted(_OPENERS))
def test_a_writable_open_beside_a_live_writer_keeps_every_record_the_writer_acknowledged(tmp_path: Path, opener: str) -> None:
    """The interleaving that lost acknowledged records: another process opens the directory
    writable (a restart, ``kvtier verify``, ``kvtier gc``) and, while it waits for
    ``segments.lock``, the live writer commits more records into its segment and releases it, and
    creates, fills and releases a new one. The open must decide each file on what is committed
    when it holds that file, not on what was committed when it started: every record reads back
    bitwise afterwards, nothing quarantined, the files exactly their committed ends."""
    path = tmp_path / "c"
    writer = Child(path, segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20, codec="raw",
                   segment_compaction_live_fraction=0)
    opener_proc: Optional[subprocess.Popen] = None
    try:
        first, more, newer = (make_batch(1, b, [RECORD] * n) for b, n in ((0, 3), (1, 2), (2, 2)))
        writer.send(op="put", seed=1, batch=0, sizes=[RECORD] * 3)  # segment 1, below 1 MiB
        lock_fd = os.open(path / "segments.lock", os.O_RDWR)
        try:
            # shared, as a writer creating a segment holds it: the opener's exclusive lock waits,
            # the writer's own creation below does not
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
            opener_proc = subprocess.Popen(_OPENERS[opener](path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _wait_until_blocked_on(opener_proc.pid, path / "segments.lock", opener_proc)
            writer.send(op="put", seed=1, batch=1, sizes=[RECORD] * 2)  # into segment 1: past 1 MiB
            writer.send(op="put", seed=1, batch=2, sizes=[RECORD] * 2)  # segment 2, created now
            writer.close()  # both segments released, every record acknowledged
        finally:
            os.close(lock_fd)  # the opener goes on
        out, err = opener_proc.communicate(timeout=120)
        assert opener_proc.returncode == 0, (out, err)
    finally:
        writer.kill()
        if opener_proc is not None and opener_proc.poll() is None:
            opener_proc.kill()
    assert len(segment_files(path)) == 2

    async def check() -> None:
        async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD) as tier:
            await assert_served(tier, first + more + newer)
            assert tier.quarantined_keys() == []
            assert_ledger_matches(tier)
            ends = tier._db.read_txn(lambda txn: committed_ends(txn, tier._db.tables.segments))
            assert segment_files(path) == ends

    asyncio.run(check())


@pytest.mark.asyncio
async def test_segment_names_never_repeat_in_a_directory(tmp_path: Path) -> None:
    """Each tier instance (and process) takes its segment numbers from the directory's counter in
    LMDB: a restarted writer does not make ``seg-<pid>-0.kvs`` again after that file was deleted."""
    path = tmp_path / "c"
    names: List[str] = []
    for round_ in range(3):
        async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
            items = make_batch(2, round_, [65536])
            await tier.put_many(items)
            (name,) = {p.name for p in pointers(tier).values()}
            names.append(name)
            assert await tier.delete_many([items[0][0]]) == 1
            assert not (path / name).exists()  # emptied: deleted at once
    assert len(set(names)) == 3, names


@pytest.mark.asyncio
async def test_a_cache_from_before_the_counter_numbers_new_segments_past_every_old_one(tmp_path: Path) -> None:
    """A cache written before segment numbers came from ``meta`` (no counter there): it opens and
    reads as it was, and its first new segment takes a number past every file and table entry."""
    path = tmp_path / "c"
    old = [make_batch(10, b, [65536]) for b in range(3)]
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
        for batch in old:
            await tier.put_many(batch)
            await asyncio.to_thread(tier._writer.call, tier._writes.segment_writer.rotate)  # a segment each
        assert await tier.delete_many([old[2][0][0]]) == 1  # the newest file goes: its number too
        numbers = sorted(int(n.rsplit("-", 1)[1][:-4]) for n in segment_files(path))
        assert numbers == [0, 1]

        def forget_counter(txn) -> None:
            with txn.cursor(db=tier._db.tables.meta) as cur:
                assert cur.set_key(b"segment_counter") and cur.delete()

        await asyncio.to_thread(tier._writer.call, lambda: tier._writes.write(lambda txn: (forget_counter(txn), lambda: None)[1]))
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
        await assert_served(tier, old[0] + old[1])
        new = make_batch(10, 3, [65536])
        await tier.put_many(new)
        # past both files (0, 1): nothing shows that 2 existed (a number freed before the counter
        # came can come back once; the readers' inode check covers that)
        assert pointers(tier)[new[0][0]].counter == 2
        await assert_served(tier, old[0] + old[1] + new)


@pytest.mark.asyncio
async def test_a_reader_in_another_process_never_reads_a_new_segment_through_a_deleted_ones_fd(tmp_path: Path) -> None:
    """A second engine keeps its segment fds open by name. Its first record's segment is deleted
    and this process, restarted, writes a new record: the other process reads it bitwise (before,
    the name came back, was read through the old file's fd, failed its checksum, and the good,
    acknowledged record was quarantined)."""
    path = tmp_path / "c"
    old = make_batch(3, 0, [65536])
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
        await tier.put_many(old)
    other = Child(path, segment_threshold_bytes=THRESHOLD)
    try:
        assert other.send(op="read", seed=3, batch=0, sizes=[65536])["bitwise"] == [True]  # its fd is open now
        async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
            assert await tier.delete_many([old[0][0]]) == 1
        assert segment_files(path) == {}
        async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
            await tier.put_many(make_batch(3, 1, [65536]))
        answer = other.send(op="read", seed=3, batch=1, sizes=[65536])
        assert (answer["bitwise"], answer["corrupt"], answer["quarantined"]) == ([True], 0, 0)
        other.close()
    finally:
        other.kill()


def test_a_cached_read_fd_serves_only_the_file_its_name_leads_to(tmp_path: Path) -> None:
    """Whatever makes a name come back (an index rebuilt beside old files, another host's process
    with the same pid), the reader checks device and inode against a fresh stat before it trusts a
    cached fd: a deleted file is a miss, a new file under the name is read from the new file."""
    first = make_batch(4, 0, [65536])[0]
    second = make_batch(4, 1, [65536])[0]
    from kvtier.tiers.record_format import encode_record

    records = [encode_record(key, meta, raw, RAW) for key, meta, raw in (first, second)]
    writer = SegmentWriter(tmp_path)  # numbers from 0 in this writer: the name repeats below
    (p1,) = writer.append([records[0]])
    writer.close()
    reader = SegmentReader(tmp_path)
    try:
        assert reader.read(p1.pack()) == records[0]  # fd cached
        os.unlink(tmp_path / p1.name)
        with pytest.raises(CorruptRecordError, match="is missing"):
            reader.read(p1.pack())
        again = SegmentWriter(tmp_path)
        (p2,) = again.append([records[1]])
        again.close()
        assert (p2.name, p2.offset, p2.length) == (p1.name, p1.offset, p1.length)
        assert reader.read(p2.pack()) == records[1]
    finally:
        reader.close()


@pytest.mark.asyncio
async def test_a_segment_whose_name_cannot_be_synced_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Power-loss order: a new segment becomes the active one only after its directory entry is
    synced. When that sync fails the put is ``TierIOError``, the tier is degraded, the file is not
    kept, and no later put is acknowledged into it; once syncing works, puts land in a new one."""
    path = tmp_path / "c"
    synced: List[str] = []
    real = segments.fsync_dir

    def failing(directory: str) -> None:
        raise OSError(errno.EIO, "Input/output error")

    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
        batches = [make_batch(5, b, [65536, 700]) for b in range(3)]
        monkeypatch.setattr(segments, "fsync_dir", failing)
        for batch in batches[:2]:
            with pytest.raises(TierIOError, match="cannot lock and sync new segment .*Input/output error"):
                await tier.put_many(batch)
            assert tier.statistics().degraded
        assert await tier.contains_many([it[0] for b in batches[:2] for it in b]) == [False] * 4
        assert segment_files(path) == {}  # the unsynced files are gone, never appended to

        def recording(directory: str) -> None:
            synced.append(directory)
            real(directory)

        monkeypatch.setattr(segments, "fsync_dir", recording)
        await tier.put_many(batches[2])
        assert not tier.statistics().degraded and synced == [str(path)]
        await assert_served(tier, batches[2])
        assert_ledger_matches(tier)
        assert await tier.check() == []


def _segments_with_data(path: Path) -> Dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in segment_files(path)}


def test_an_empty_or_missing_index_beside_segment_files_is_damage_and_nothing_is_deleted(tmp_path: Path, capsys) -> None:
    """``: > data.mdb`` (or a deleted one) beside the segment files is a lost index, not a new
    cache: ``verify``, ``gc`` and ``inspect`` exit 2 with the advice and delete nothing (before,
    verify reported 0 records, deleted every segment as an orphan and made a fresh data.mdb); an
    engine's open moves the segments aside with the index."""
    path = tmp_path / "c"

    async def fill() -> None:
        async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
            await tier.put_many(make_batch(6, 0, [65536, 131072, 700]))

    asyncio.run(fill())
    before = _segments_with_data(path)
    assert len(before) == 1
    (path / "data.mdb").write_bytes(b"")
    for argv in (["verify", "--cache-dir", str(path)], ["gc", "--cache-dir", str(path), "--max-bytes", "0"],
                 ["inspect", "--cache-dir", str(path)]):
        assert main(argv) == 2, argv
        err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
        assert len(err) == 1 and err[0].startswith("kvtier: error: "), err
        assert "data.mdb is empty but 1 payload segment files (seg-*.kvs) lie beside it" in err[0], err
        assert _segments_with_data(path) == before and (path / "data.mdb").stat().st_size == 0
        if argv[0] == "verify":  # docs/cli.md's advice
            assert "no record was checked, quarantined or deleted" in err[0]
            assert f"move {path}'s data.mdb and seg-*.kvs files aside" in err[0]
    (path / "data.mdb").unlink()
    with pytest.raises(CorruptCacheError, match="data.mdb is missing but 1 payload segment files"):
        LmdbTier(path)
    assert _segments_with_data(path) == before and not (path / "data.mdb").exists()
    aside = quarantine_cache_dir(path)  # what an engine does with a damaged directory
    assert _segments_with_data(aside) == before and segment_files(path) == {}
    with LmdbTier(path) as tier:  # now a new cache
        assert tier.statistics().records == 0


def _deleted_segment_links(path: Path) -> List[str]:
    """Files of ``path`` this process still holds open although they were deleted."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)) and target.endswith(" (deleted)"):
            out.append(target)
    return out


def _open_segment_fds(path: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(path / "seg-"))
    return n


@pytest.mark.asyncio
async def test_compaction_gives_back_the_disk_space_of_the_segments_it_deletes(tmp_path: Path) -> None:
    """Segments compaction read and deleted are not held open: no link to a deleted segment is left
    in /proc/self/fd, so ``compaction_bytes_freed`` is space the disk really got back (before,
    every source stayed open until the tier closed)."""
    path = tmp_path / "c"
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20, codec=RAW,
                                   segment_compaction_live_fraction=0) as tier:
        batches = [make_batch(7, b, [RECORD] * 4) for b in range(4)]
        for batch in batches:
            await tier.put_many(batch)  # one segment each
        await assert_served(tier, [it for b in batches for it in b])  # every segment's fd cached
        names = {p.name for p in pointers(tier).values()}
        sizes = segment_files(path)
        assert len(names) == 4
        for batch in batches[:3]:
            assert await tier.delete_many([it[0] for it in batch[1:]]) == 3
        report = await tier.compact_segments(live_fraction=0.5)
        gone = set(sizes) - set(segment_files(path))
        assert report.files_freed == len(gone) == 3
        assert tier.statistics().extra["compaction_bytes_freed"] == sum(sizes[n] for n in gone)
        assert _deleted_segment_links(path) == []
        await assert_served(tier, [b[0] for b in batches[:3]] + batches[3])
        assert _deleted_segment_links(path) == []


def test_open_read_fds_stay_bounded_and_a_dropped_one_closes_when_its_last_read_ends(tmp_path: Path) -> None:
    """The reader keeps at most ``max_open`` fds (least recently used closed first) over any number
    of segments; an fd dropped while a read still uses it is closed when that read ends, not
    before (closing it under a ``preadv`` could hand its number to another file)."""
    from kvtier.tiers.record_format import encode_record

    batch = make_batch(8, 0, [20_000] * 40)
    records = [encode_record(key, meta, raw, RAW) for key, meta, raw in batch]
    writer = SegmentWriter(tmp_path)
    placed = []
    for record in records:  # a segment per record
        placed.append(writer.append([record])[0])
        writer.rotate()
    writer.close()
    reader = SegmentReader(tmp_path, max_open=8)
    try:
        for _ in range(2):
            for pointer, record in zip(placed, records):
                assert reader.read(pointer.pack()) == record
                assert _open_segment_fds(tmp_path) <= 8
        assert reader.open_count() == 8
        name = placed[-1].name
        with reader._using(name) as fd:
            reader.forget([name])
            assert os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / name)  # still open for this read
        assert reader.open_count() == 7
        assert _open_segment_fds(tmp_path) == 7
    finally:
        reader.close()
    assert _open_segment_fds(tmp_path) == 0


def _chattr(path: Path, flag: str) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


@pytest.mark.asyncio
async def test_a_segment_that_cannot_be_deleted_after_its_commit_fails_nothing(tmp_path: Path) -> None:
    """The commit that emptied a segment stands whatever deleting the file does: a put whose
    evictions emptied an undeletable segment (immutable: EPERM) returns its sequence, its evictions
    are reported, the index and the tables agree; the file is left, and the next open deletes it."""
    path = tmp_path / "c"
    removals: List[Removal] = []
    first, second = make_batch(9, 0, [RECORD] * 4), make_batch(9, 1, [RECORD] * 4)
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20, codec=RAW,
                                   capacity_bytes=1_300_000, segment_compaction_live_fraction=0) as tier:
        tier.subscribe_removals(removals.extend)
        await tier.put_many(first)
        (name,) = {p.name for p in pointers(tier).values()}
        if not _chattr(path / name, "+i"):
            pytest.skip("cannot make a file immutable here (chattr needs root and ext4/xfs/btrfs)")
        try:
            sequence = await tier.put_many(second)  # evicts every record of `first`: its segment empties
            assert sequence == tier.sequence
            for _ in range(100):  # reported on the loop
                if len(removals) >= 4:
                    break
                await asyncio.sleep(0.01)
            assert sorted((r.key, r.reason, r.sequence) for r in removals) == sorted(
                (it[0], "evicted", sequence) for it in first)
            assert tier.statistics().evictions == 4
            assert await tier.check() == []
            assert_ledger_matches(tier)
            assert (path / name).exists()
            await assert_served(tier, second)
        finally:
            _chattr(path / name, "-i")
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD) as tier:
        assert not (path / name).exists()  # an orphan: reclaimed
        await assert_served(tier, second)


def test_a_pointer_cache_without_its_segments_table_is_damage_and_no_segment_is_deleted(tmp_path: Path) -> None:
    """A tier format b"2" cache always has its ``segments`` table (the first writable open creates
    it with the marker). Without it every segment's ledger is gone: the open says the cache is
    damaged instead of taking the files for orphans (before, it created the table empty and
    deleted every payload)."""
    import lmdb

    path = tmp_path / "c"
    with LmdbTier(path, segment_threshold_bytes=THRESHOLD, codec=RAW) as tier:
        asyncio.run(tier.put_many(make_batch(4, 0, [65536, 131072])))
    before = _segments_with_data(path)
    assert before
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"segments", txn=txn), delete=True)
    env.close()
    for readonly in (False, True):
        with pytest.raises(CorruptCacheError, match=r"tier format b'2' cache without its 'segments' table \(damaged\)"):
            LmdbTier(path, readonly=readonly)
    assert _segments_with_data(path) == before


def test_a_reclaim_leaves_a_segment_another_process_deleted_between_its_open_and_its_lock(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    # Another process's remove_dead locks an emptied segment, unlinks it and drops the lock; a
    # reclaim that opened the file just before then gets the lock on an unlinked inode. Deleting
    # it again failed the writable open ("cannot reclaim orphan segments ... No such file").
    from kvtier.tiers.lmdb import segment_files as files

    name = segments.segment_name(4242, 7)
    (tmp_path / name).write_bytes(b"\0" * 4096)
    really_locked_elsewhere = files._locked_elsewhere

    def removed_meanwhile(fd: int) -> bool:
        os.unlink(tmp_path / name)  # what the other process's remove_dead did, then unlocked
        return really_locked_elsewhere(fd)

    monkeypatch.setattr(files, "_locked_elsewhere", removed_meanwhile)
    assert files.reclaim_orphans(tmp_path, lambda: {}) == (0, 0)
    assert files.segment_files(tmp_path) == []


def _record_fsync_dir(monkeypatch: pytest.MonkeyPatch, fail_on: Optional[str] = None) -> List[str]:
    """Make ``segments.fsync_dir`` record the thread that calls it, "writer" or "opener" (and fail
    on the thread ``fail_on`` names, as a disk that cannot sync the directory)."""
    calls: List[str] = []
    real = segments.fsync_dir

    def recording(directory: str) -> None:
        name = threading.current_thread().name
        calls.append("opener" if name.startswith("kvtier-segment-open") else
                     "writer" if name.startswith("kvtier-lmdb-writer") else name)
        if fail_on is not None and calls[-1] == fail_on:
            raise OSError(errno.EIO, "Input/output error")
        real(directory)

    monkeypatch.setattr(segments, "fsync_dir", recording)
    return calls


@pytest.mark.asyncio
async def test_the_next_segment_is_made_ahead_off_the_writer_and_the_rotation_only_switches_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past half its segment the writer has its successor created, locked and name-synced on the
    opener thread; the rotation then makes that file the active one without a create, lock or sync
    of its own. The spare is locked (an open of another process leaves it), has no entry in the
    ledger, is never written before it is active, and a closing tier removes it: the files left
    are exactly the committed ends. Its number stays a gap: names never repeat."""
    path = tmp_path / "c"
    calls = _record_fsync_dir(monkeypatch)
    batches = [make_batch(9, b, [RECORD] * 2) for b in range(3)]
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20,
                                   codec=RAW) as tier:
        await tier.put_many(batches[0])  # 600 KB: past half of the first segment
        writer = tier._writes.segment_writer
        first, spare = writer.active, writer.spare
        assert first is not None and spare is not None and spare != first
        await asyncio.to_thread(lambda: writer._spare[1].result(WAIT_S))
        assert calls == ["writer", "opener"]  # the first segment, then the spare
        assert segment_files(path)[spare] == 0 and held_by_writer(path, spare) is True
        assert spare not in tier._db.read_txn(lambda txn: committed_ends(txn, tier._db.tables.segments))
        await tier.put_many(batches[1])  # the first segment past its size
        await tier.put_many(batches[2])  # rotates: into the spare
        assert writer.active == spare and writer.spare not in (None, first, spare)  # and the next one ahead
        assert calls[:2] == ["writer", "opener"] and "writer" not in calls[1:]  # the rotation synced nothing
        assert {p.name for p in pointers(tier).values()} == {first, spare}
        await assert_served(tier, [it for b in batches for it in b])
        names = {first, spare}
    assert calls.count("writer") == 1
    assert set(segment_files(path)) == names  # closed: the spare made ahead of the second segment removed
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20,
                                   codec=RAW) as tier:
        more = [make_batch(9, b, [RECORD] * 2) for b in range(3, 5)]
        for batch in more:
            await tier.put_many(batch)
        spare_after_restart = tier._writes.segment_writer.spare
        assert spare_after_restart is not None
        new = {p.name for p in pointers(tier).values()} - names
        await assert_served(tier, [it for b in batches + more for it in b])
    assert len(new) == 1 and not new & names and spare_after_restart not in names | new
    assert set(segment_files(path)) == names | new  # the second spare removed at close too


@pytest.mark.asyncio
async def test_a_spare_whose_name_cannot_be_synced_fails_the_rotation_and_is_never_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spare's directory sync fails on the opener thread: the batch that needs it gets that
    error (``TierIOError``, the tier degraded), nothing of it is visible, the file is gone; the next
    rotation creates a segment itself, and once syncing works puts land there."""
    path = tmp_path / "c"
    calls = _record_fsync_dir(monkeypatch, fail_on="opener")
    batches = [make_batch(10, b, [RECORD] * 2) for b in range(4)]
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20,
                                   codec=RAW) as tier:
        await tier.put_many(batches[0])
        await tier.put_many(batches[1])
        spare = tier._writes.segment_writer.spare
        assert spare is not None
        with pytest.raises(TierIOError, match="cannot lock and sync new segment .*Input/output error"):
            await tier.put_many(batches[2])
        assert tier.statistics().degraded
        assert await tier.contains_many([it[0] for it in batches[2]]) == [False, False]
        assert spare not in segment_files(path)
        assert calls == ["writer", "opener"]
        calls = _record_fsync_dir(monkeypatch)  # syncing works again
        await tier.put_many(batches[3])  # a segment of its own, created and synced on the writer
        assert not tier.statistics().degraded
        assert calls[0] == "writer" and set(calls[1:]) <= {"opener"}  # then perhaps its own spare
        await assert_served(tier, batches[0] + batches[1] + batches[3])
        assert_ledger_matches(tier)
        assert await tier.check() == []


def test_a_writer_killed_with_a_spare_leaves_an_orphan_the_next_open_removes(tmp_path: Path) -> None:
    """kill -9 of a process whose next segment was made ahead: the spare (empty, no ledger entry)
    is an orphan the next writable open deletes; every record the process acknowledged reads back
    bitwise and the files are exactly their committed ends."""
    path = tmp_path / "c"
    child = Child(path, segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20, codec="raw")
    try:
        child.send(op="put", seed=11, batch=0, sizes=[RECORD] * 2)
        child.send(op="put", seed=11, batch=1, sizes=[RECORD] * 2)  # past the size: a spare made ahead
        deadline = time.monotonic() + WAIT_S
        while len(segment_files(path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        child.kill()
    files = segment_files(path)
    assert len(files) == 2 and sorted(files.values())[0] == 0  # the spare, empty

    async def check() -> None:
        async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD) as tier:
            await assert_served(tier, make_batch(11, 0, [RECORD] * 2) + make_batch(11, 1, [RECORD] * 2))
            assert tier.quarantined_keys() == []
            ends = tier._db.read_txn(lambda txn: committed_ends(txn, tier._db.tables.segments))
            assert segment_files(path) == ends and len(ends) == 1

    asyncio.run(check())
