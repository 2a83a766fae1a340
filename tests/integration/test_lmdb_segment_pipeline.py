"""The LMDB tier's pipelined put path: batch n+1's segment writes begin as soon as it is queued --
while batch n's own writes are still in flight, and while batch n syncs and commits -- and each
batch is still acknowledged (and its pointers committed) only once its own payload is synced.

The payload I/O is held at a real blocking point: the segment writer's hook runs on the lane
thread right before each ``pwritev`` and on the sync thread before each ``fdatasync``; the tier's
I/O hook runs before each commit. The tests record that order."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path
from typing import List, Tuple

import lmdb
import pytest

from kvtier.errors import TierIOError
from kvtier.tiers.base import IOHook
from kvtier.tiers.lmdb import LmdbTier, segments
from kvtier.tiers.record_format import CodecConfig
from kvtier.tools.testing.children import make_batch
from segment_checks import assert_served
from segment_checks import ledger as _ledger
from segment_checks import pointers as _pointers
from segment_checks import segment_files as _segment_files
from segment_checks import skip_without_fallocate

THRESHOLD = 16 << 10
WAIT_S = 10.0
A_RUNS = 3  # batch A's direct writes: its 3 records, one run each (split so 3 lanes have one)
B_RUNS = 3


class _Order(IOHook):
    """Records "write" / "sync" (segment writer) and "commit" (tier); holds the first segment write
    (batch A's) until ``release_a`` and the first write after A's (batch B's) until
    ``release_b``."""

    def __init__(self) -> None:
        self.events: List[str] = []
        self._lock = threading.Lock()
        self.a_held = threading.Event()
        self.release_a = threading.Event()
        self.b_held = threading.Event()
        self.release_b = threading.Event()

    def before(self, op: str) -> None:  # the tier's hook: puts, commits, reads
        if op == "commit":
            self._add("commit")

    def segment(self, op: str) -> None:  # the segment writer's hook
        with self._lock:
            writes = self.events.count("write") + self.events.count("B write held")
            first_a = op == "write" and writes == 0
            first_b = op == "write" and writes == A_RUNS
            if first_a:
                self.a_held.set()
            if first_b:
                self.b_held.set()
                self.events.append("B write held")
            else:
                self.events.append(op)
        if first_a:
            self.release_a.wait(WAIT_S)
        if first_b:
            self.release_b.wait(WAIT_S)

    def _add(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    def count(self, event: str) -> int:
        with self._lock:
            return self.events.count(event)


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.asyncio
async def test_next_batch_writes_begin_while_the_batch_before_is_written_and_each_ack_waits_for_its_own_sync(
        tmp_path: Path) -> None:
    warm = make_batch(1, 0, [65536])
    a = make_batch(2, 1, [65536, 65536, 65536])
    b = make_batch(3, 2, [65536, 65536, 65536])
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(warm)  # opens the segment writer
        order = _Order()
        tier._io_hook = order
        tier._writes.segment_writer.hook = order.segment
        put_a = asyncio.ensure_future(tier.put_many(a))
        assert await asyncio.to_thread(order.a_held.wait, WAIT_S)
        await _until(lambda: order.count("write") == A_RUNS, "A's three writes begun")
        put_b = asyncio.ensure_future(tier.put_many(b))
        # B's first write begins while A's first write is still held: the writer does not wait for
        # a batch's slowest write before it starts the next batch.
        assert await asyncio.to_thread(order.b_held.wait, WAIT_S)
        assert not put_a.done() and not put_b.done()
        assert order.count("sync") == 0 and order.count("commit") == 0
        assert await tier.contains_many([key for key, _, _ in a + b]) == [False] * 6
        order.release_a.set()
        # A is acknowledged while B's payload write is still held, after its own sync ...
        assert await asyncio.wait_for(put_a, 3 * WAIT_S) > 0
        assert order.b_held.is_set() and not put_b.done()
        assert order.events.index("sync") < order.events.index("commit")
        assert order.count("commit") == 1 and order.count("sync") == 1
        # ... and B is not visible (no pointer to its unwritten bytes) until its own sync and commit.
        assert await tier.contains_many([key for key, _, _ in b]) == [False] * 3
        order.release_b.set()
        await asyncio.wait_for(put_b, WAIT_S)
        tail = order.events[order.events.index("commit") + 1:]
        assert tail[-2:] == ["sync", "commit"] and "write" not in tail[tail.index("sync"):]
        assert order.count("write") + order.count("B write held") == A_RUNS + B_RUNS
        tier._io_hook = IOHook()
        await assert_served(tier, warm + a + b)
        assert await tier.check() == []


class _FailFirstSync:
    """The segment writer's hook: the first ``fdatasync`` (batch A's) waits until B's writes are
    all done, then fails with EIO; every later one proceeds (a real ``fdatasync`` after it may
    return 0: the kernel reports a writeback error once per open file)."""

    def __init__(self) -> None:
        self.syncs = 0
        self.writes = 0
        self._lock = threading.Lock()
        self.a_sync_held = threading.Event()
        self.b_written = threading.Event()

    def __call__(self, op: str) -> None:
        with self._lock:
            if op == "write":
                self.writes += 1
                if self.writes == A_RUNS + B_RUNS:
                    self.b_written.set()
                return
            self.syncs += 1
            first = self.syncs == 1
        if first:
            self.a_sync_held.set()
            self.b_written.wait(WAIT_S)
            raise OSError(errno.EIO, "injected fdatasync failure")


@pytest.mark.asyncio
async def test_a_failed_sync_fails_every_batch_of_its_segment_begun_behind_it(tmp_path: Path) -> None:
    warm = make_batch(1, 0, [65536])
    a = make_batch(2, 1, [65536, 65536, 65536])
    b = make_batch(3, 2, [65536, 65536, 65536])
    c = make_batch(4, 3, [65536, 65536])
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(warm)
        segment = tier._writes.active_segment
        hook = _FailFirstSync()
        tier._writes.segment_writer.hook = hook
        put_a = asyncio.ensure_future(tier.put_many(a))
        assert await asyncio.to_thread(hook.a_sync_held.wait, WAIT_S)
        put_b = asyncio.ensure_future(tier.put_many(b))  # begun in A's segment, synced after A's failed
        with pytest.raises(TierIOError, match="injected fdatasync failure"):
            await asyncio.wait_for(put_a, WAIT_S)
        with pytest.raises(TierIOError, match="an earlier fdatasync of segment"):
            await asyncio.wait_for(put_b, WAIT_S)
        assert hook.syncs == 1  # B's sync was refused, not tried: a 0 from it would prove nothing
        assert await tier.contains_many([key for key, _, _ in a + b]) == [False] * 6
        tier._writes.segment_writer.hook = lambda op: None
        await tier.put_many(c)  # a fresh segment: the failed one is never appended to again
        assert tier._writes.active_segment != segment
        await assert_served(tier, warm + c)
        assert await tier.check() == []


class _Hold:
    """The segment writer's hook: while ``holding`` is set, the next direct write waits at its
    ``pwritev`` until ``release`` (one write held at a time)."""

    def __init__(self) -> None:
        self.holding = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()

    def segment(self, op: str) -> None:
        if op == "write" and self.holding.is_set():
            self.holding.clear()
            self.held.set()
            self.release.wait(WAIT_S)


@pytest.mark.asyncio
async def test_a_batch_begun_behind_another_allocates_the_rest_of_the_segment_and_the_tail_goes_back_after_its_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put begun alone allocates ALLOCATE_AHEAD_BATCHES batches of its size; one begun while
    another is in flight and past those blocks allocates the rest of its segment (ext4's
    fallocate waits for every direct write in flight to the file: allocating batch by batch held
    the writer until the batch before was written); the batches after it allocate nothing; a new
    segment begun behind a batch in flight is allocated whole at once; and once a segment rotates
    its unused blocks go back -- only after the writes still in flight to it are done: every
    segment ends exactly at its committed end."""
    skip_without_fallocate(tmp_path)
    max_bytes = 1 << 20
    ahead = segments.ALLOCATE_AHEAD_BATCHES
    allocations: List[Tuple[str, int, int]] = []
    real = segments._fallocate

    def recording(fd: int, offset: int, length: int) -> bool:
        allocations.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(segments, "_fallocate", recording)
    path = tmp_path / "c"
    warm = make_batch(7, 99, [65536])  # one record: its look-ahead covers A's three, not B's
    batches = [make_batch(7, n, [65536, 65536, 65536]) for n in range(9)]
    async with await LmdbTier.open(path, codec=CodecConfig(compress=False), segment_threshold_bytes=THRESHOLD,
                                   segment_max_bytes=max_bytes) as tier:
        await tier.put_many(warm)  # opens the segment writer: a lone batch
        writer = tier._writes.segment_writer
        extent = _pointers(tier)[warm[0][0]].extent
        batch_extent = 3 * extent
        (first,) = {name for name, _, _ in allocations}
        assert allocations == [(first, 0, ahead * extent)]
        hold = _Hold()
        writer.hook = hold.segment
        hold.holding.set()
        put_a = asyncio.ensure_future(tier.put_many(batches[0]))  # alone, inside the blocks ahead
        assert await asyncio.to_thread(hold.held.wait, WAIT_S)
        put_b = asyncio.ensure_future(tier.put_many(batches[1]))  # begun while A's write is held
        put_c = asyncio.ensure_future(tier.put_many(batches[2]))
        await _until(lambda: writer._end == extent + 3 * batch_extent, "B and C begun")
        assert not put_a.done()
        hold.release.set()
        await asyncio.wait_for(asyncio.gather(put_a, put_b, put_c), WAIT_S)
        # B behind A: the rest of the segment and one more of B's size (B and C queued together
        # are staged as one group: twice the size); A and C: nothing
        assert len(allocations) == 2
        name, start, length = allocations[1]
        assert (name, start) == (first, ahead * extent)
        group = start + length - max_bytes
        assert group in (batch_extent, 2 * batch_extent)
        files = _segment_files(path)
        # past half the segment its successor is made ahead: empty (it may still be being created)
        assert writer.spare is not None and files.pop(writer.spare, 0) == 0
        assert files == {first: max_bytes + group}  # active: allocated ahead
        # lone batches fill the allocated blocks without allocating more
        n = 3
        while extent + (n + 1) * batch_extent < max_bytes:
            await tier.put_many(batches[n])
            n += 1
        assert len(allocations) == 2
        # the batch that crosses the segment's size is held in flight; the one after it rotates
        hold.held.clear()
        hold.release.clear()
        hold.holding.set()
        crossing = asyncio.ensure_future(tier.put_many(batches[n]))
        assert await asyncio.to_thread(hold.held.wait, WAIT_S)
        after = asyncio.ensure_future(tier.put_many(batches[n + 1]))
        await _until(lambda: writer.active not in (None, first), "the rotation")
        # the old segment keeps its allocated blocks while the crossing batch's write is in flight
        assert _segment_files(path)[first] == max_bytes + group
        hold.release.set()
        await asyncio.wait_for(asyncio.gather(crossing, after), WAIT_S)
        ends = {name: end for name, (_, _, end) in _ledger(tier).items()}
        assert ends[first] == extent + (n + 1) * batch_extent
        await _until(lambda: _segment_files(path)[first] == ends[first], "the old segment's tail given back")
        second = writer.active
        # behind the crossing batch: the new file allocated whole at once (nothing in flight to it)
        assert allocations[2:] == [(second, 0, max_bytes + batch_extent)]
        await assert_served(tier, warm + [it for batch in batches[: n + 2] for it in batch])
        assert await tier.check() == []
    # closed: every segment ends exactly at its committed end
    assert _segment_files(path) == ends


@pytest.mark.asyncio
async def test_put_batches_are_encoded_on_their_own_threads_never_more_at_once_than_cores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding (checksums, zstd) is CPU work: four batches put at once are encoded on the encode
    threads, at most as many slices at a time as this process has cores (and read threads), so
    the first batch is not encoded only as late as the last; never on the read threads, whose
    reads then never queue behind an encode."""
    from kvtier.tiers.lmdb import reads

    running: List[int] = [0]
    most: List[int] = [0]
    threads: set = set()
    lock = threading.Lock()
    real = reads.encode_for_segments

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            threads.add(threading.current_thread().name)
        try:
            threading.Event().wait(0.002)  # long enough for the slices in flight to overlap
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(reads, "encode_for_segments", counted)
    batches = [make_batch(9, n, [65536] * 8) for n in range(4)]
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD, read_workers=8) as tier:
        await asyncio.gather(*(tier.put_many(batch) for batch in batches))
        await assert_served(tier, [it for batch in batches for it in batch])
    cores = len(os.sched_getaffinity(0))
    assert 1 <= most[0] <= min(8, cores)
    assert threads and all(name.startswith("kvtier-lmdb-encode") for name in threads)
    assert len(threads) <= min(8, cores)
    assert reads.encode_threads(8) == min(8, cores) and reads.encode_threads(1) == 1


class _HoldFirstSync:
    """The segment writer's hook: the first ``fdatasync`` waits until ``release``."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.release = threading.Event()
        self._syncs = 0
        self._lock = threading.Lock()

    def __call__(self, op: str) -> None:
        if op != "sync":
            return
        with self._lock:
            self._syncs += 1
            first = self._syncs == 1
        if first:
            self.held.set()
            self.release.wait(WAIT_S)


class _Commits(IOHook):
    """The tier's hook: for each write transaction that reached its commit, in order, the "put"
    operations since the commit before (each record put, and each batch's start of its segment
    writes: one a batch of segment records); ``fail_first``: the first such commit raises (the
    transaction aborts)."""

    def __init__(self, fail_first: bool = False) -> None:
        self.records: List[int] = []
        self._puts = 0
        self._fail_first = fail_first

    def before(self, op: str) -> None:
        if op == "put":
            self._puts += 1
        elif op == "commit":
            self.records.append(self._puts)
            self._puts = 0
            if self._fail_first and len(self.records) == 1:
                raise lmdb.Error("injected commit failure")


async def _put_behind_a_held_sync(tier: LmdbTier, head: List, behind: List[List]) -> List[int]:
    """Put ``head`` (segment records) and hold its sync until each batch of ``behind`` (inline
    records: nothing of theirs to sync) was staged by the writer behind it; then let it go and
    return every put's sequence, in order."""
    hold = _HoldFirstSync()
    tier._writes.segment_writer.hook = hold
    staged: List[int] = [0]
    real_stage = tier._writes._stage_group

    def counting(group):  # type: ignore[no-untyped-def]
        staged[0] += len(group)
        return real_stage(group)

    tier._writes._stage_group = counting  # type: ignore[method-assign]
    put_head = asyncio.ensure_future(tier.put_many(head))
    assert await asyncio.to_thread(hold.held.wait, WAIT_S)
    puts = [asyncio.ensure_future(tier.put_many(batch)) for batch in behind]
    await _until(lambda: staged[0] == 1 + len(behind), "the batches behind staged")
    assert not put_head.done()
    hold.release.set()
    return list(await asyncio.wait_for(asyncio.gather(put_head, *puts), WAIT_S))


def _head_and_behind(seed: int) -> Tuple[List, List, List, List]:
    """A warm-up batch (it opens the segment writer), A (segment records) and B, C (inline
    records: nothing of theirs to sync)."""
    return (make_batch(seed, 0, [65536]), make_batch(seed, 1, [65536, 65536]), make_batch(seed, 2, [1024, 2048]),
            make_batch(seed, 3, [4096]))


@pytest.mark.asyncio
async def test_batches_already_synced_behind_the_one_committing_next_share_its_transaction(tmp_path: Path) -> None:
    """A group commit: while batch A's payload syncs, B and C are staged behind it with nothing
    left to sync; once A is durable the three commit in one write transaction (one sequence,
    one sync of the environment) instead of three."""
    warm, a, b, c = _head_and_behind(11)
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(warm)  # opens the segment writer
        commits = _Commits()
        tier._io_hook = commits
        before = tier.statistics().extra["put_commits"]
        sequences = await _put_behind_a_held_sync(tier, a, [b, c])
        assert commits.records == [1 + 5]  # A's segment writes, then the 5 records of A, B and C
        assert len(set(sequences)) == 1
        assert tier.statistics().extra["put_commits"] == before + 1
        tier._io_hook = IOHook()
        await assert_served(tier, warm + a + b + c)
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_a_failed_group_commit_commits_each_batch_alone(tmp_path: Path) -> None:
    """The transaction of A, B and C fails: each commits on its own afterwards (its payload is
    already durable, nothing is written again), every put is acknowledged, in order."""
    warm, a, b, c = _head_and_behind(12)
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(warm)
        commits = _Commits(fail_first=True)
        tier._io_hook = commits
        sequences = await _put_behind_a_held_sync(tier, a, [b, c])
        # A alone, then B and C (one group when both were queued by the time the writer took B)
        assert commits.records[:2] == [1 + 5, 2] and commits.records[2:] in ([2, 1], [3])
        assert sequences[0] < sequences[1] <= sequences[2]  # in the queue's order
        tier._io_hook = IOHook()
        await assert_served(tier, warm + a + b + c)
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_batches_that_fit_the_capacity_only_apart_commit_apart(tmp_path: Path) -> None:
    """A and B each fit the capacity, together they do not: they are not committed together
    (the evictions that make room for one batch are chosen among every other record), and both
    are acknowledged, B evicting what it must."""
    a = make_batch(13, 1, [65536, 65536])
    b = make_batch(13, 2, [12000])
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD, capacity_bytes=135_000) as tier:
        await tier.put_many(make_batch(13, 0, [65536]))
        together: List[int] = []
        real_commit = tier._writes.commit_put

        def recording(*staged):  # type: ignore[no-untyped-def]
            together.append(len(staged))
            return real_commit(*staged)

        tier._writes.commit_put = recording  # type: ignore[method-assign]
        sequences = await _put_behind_a_held_sync(tier, a, [b])
        assert together == [1, 1] and sequences[0] < sequences[1]
        await assert_served(tier, b)
        assert tier.statistics().bytes <= 135_000
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_a_rotation_takes_the_number_its_writer_reserved_in_an_earlier_commit(tmp_path: Path) -> None:
    """The first segment's number costs a write transaction of its own; every commit of segment
    records then leaves a number reserved for the next one, so a rotation commits nothing of its
    own. Numbers still never repeat: the directory's counter is past every one handed out."""
    path = tmp_path / "c"
    async with await LmdbTier.open(path, codec=CodecConfig(compress=False), segment_threshold_bytes=THRESHOLD) as tier:
        commits = _Commits()
        tier._io_hook = commits
        first = make_batch(14, 0, [65536])
        await tier.put_many(first)
        assert commits.records == [1, 1]  # the number (after the batch's start), then the batch
        await asyncio.to_thread(tier._writer.call, tier._writes.segment_writer.rotate)
        second = make_batch(14, 1, [65536, 65536])
        await tier.put_many(second)
        assert commits.records == [1, 1, 1 + 2]  # the rotation took the reserved number
        numbers = {p.counter for p in _pointers(tier).values()}
        assert numbers == {_pointers(tier)[first[0][0]].counter, _pointers(tier)[first[0][0]].counter + 1}
        counter = tier._db.read_txn(lambda txn: bytes(txn.get(b"segment_counter", db=tier._db.tables.meta)))
        assert int.from_bytes(counter, "little") > max(numbers)  # the next one is reserved too
        tier._io_hook = IOHook()
    async with await LmdbTier.open(path, codec=CodecConfig(compress=False), segment_threshold_bytes=THRESHOLD) as tier:
        third = make_batch(14, 2, [65536])
        await tier.put_many(third)  # a new writer: a number past the one reserved and never used
        assert _pointers(tier)[third[0][0]].counter == int.from_bytes(counter, "little")
        await assert_served(tier, first + second + third)
