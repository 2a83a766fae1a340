"""The LMDB disk tier against a real LMDB environment: round trips, corruption in the data file,
map growth, capacity eviction, directory safety, reopen, a second process, concurrency, disk full,
cancellation and fork safety."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

from kvtier.errors import (
    ClosedError,
    ForkedProcessError,
    TierFullError,
    TierIOError,
    UnsafeDirectoryError,
)
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig, encode_record, read_header
from kvtier.tools.testing.faults import corrupt_stored_record

Item = Tuple[bytes, ChunkMeta, memoryview]


def _key(i: int, tag: bytes = b"k") -> bytes:
    return (tag + i.to_bytes(8, "little")).ljust(32, b"\0")


def _item(i: int, dtype: torch.dtype = torch.bfloat16, shape: tuple = (7, 33), *, random: bool = False) -> Item:
    g = torch.Generator().manual_seed(i)
    if random:  # incompressible bytes: sizes on disk are predictable
        t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    else:
        t = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    name = str(t.dtype).removeprefix("torch.")
    meta = ChunkMeta(b"layout-fp", 0, i, name, tuple(t.shape))
    return _key(i), meta, memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def _buf(item: Item) -> memoryview:
    return memoryview(bytearray(item[2].nbytes))


async def _get(tier: LmdbTier, items: List[Item]) -> List[Tuple[object, bytes]]:
    bufs = [_buf(it) for it in items]
    metas = await tier.get_many_into([(it[0], b) for it, b in zip(items, bufs)])
    return [(m, bytes(b)) for m, b in zip(metas, bufs)]


async def _assert_served(tier: LmdbTier, items: List[Item]) -> None:
    for (meta, data), it in zip(await _get(tier, items), items):
        assert meta == it[1]
        assert data == it[2].tobytes()


# -------------------------------------------------------------------------------------- round trips


@pytest.mark.asyncio
async def test_round_trip_bitwise_for_kv_dtypes(tmp_path: Path) -> None:
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
    shapes = [(3, 5, 7), (1,), (17, 129), (2, 3, 64, 5)]
    items = [_item(i, dt, sh) for i, (dt, sh) in enumerate((d, s) for d in dtypes for s in shapes)]
    async with await LmdbTier.open(tmp_path / "c") as tier:
        await tier.put_many(items)
        slots = [torch.zeros(it[2].nbytes, dtype=torch.uint8) for it in items]  # host slots
        metas = await tier.get_many_into([(it[0], memoryview(s.numpy())) for it, s in zip(items, slots)])
        for it, meta, slot in zip(items, metas, slots):
            assert meta == it[1]
            assert bytes(slot.numpy()) == it[2].tobytes()
        assert await tier.contains_many([items[0][0], _key(999)]) == [True, False]
        assert sorted(await tier.list_keys()) == sorted(it[0] for it in items)
        assert await tier.get_many_into([(_key(999), memoryview(bytearray(4)))]) == [None]
        stats = tier.statistics().as_dict()
        assert stats["records"] == len(items) and stats["compressed_records"] > 0
        assert stats["hits"] == len(items) and stats["misses"] == 1
        assert await tier.delete_many([items[0][0], _key(999)]) == 1
        assert await tier.contains_many([items[0][0]]) == [False]
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_wrong_buffer_size_is_a_miss_not_corruption(tmp_path: Path) -> None:
    it = _item(1)
    async with await LmdbTier.open(tmp_path / "c") as tier:
        await tier.put_many([it])
        assert await tier.get_many_into([(it[0], memoryview(bytearray(it[2].nbytes + 1)))]) == [None]
        stats = tier.statistics().as_dict()
        assert stats["mismatched"] == 1 and stats["corrupt"] == 0
        await _assert_served(tier, [it])


# -------------------------------------------------------------------------------------- corruption


@pytest.mark.asyncio
async def test_flipped_bytes_in_data_file_are_always_detected(tmp_path: Path) -> None:
    path = tmp_path / "c"
    victims = [_item(i, shape=(16, 256), random=i % 2 == 0) for i in range(24)]
    control = [_item(100 + i, shape=(16, 256)) for i in range(4)]
    async with await LmdbTier.open(path) as tier:
        await tier.put_many(victims + control)

    data = bytearray((path / "data.mdb").read_bytes())
    for n, (key, meta, raw) in enumerate(victims):
        record = encode_record(key, meta, raw, CodecConfig())  # deterministic: the stored bytes
        at = data.find(record)
        assert at >= 0 and data.find(record, at + 1) < 0
        header = read_header(record)
        start = 10 + header.header_length
        # Most flips land in the payload; every fourth in the header or its checksum.
        pos = at + (start + (n * 7919) % header.payload_length if n % 4 else 12 + n % (header.header_length - 2))
        data[pos] ^= 1 << (n % 8)
    (path / "data.mdb").write_bytes(bytes(data))

    async with await LmdbTier.open(path) as tier:
        results = await _get(tier, victims)
        assert [m for m, _ in results] == [None] * len(victims)  # 100% detected, never returned
        await _assert_served(tier, control)
        assert tier.statistics().as_dict()["corrupt"] == len(victims)
        await tier.flush()  # the writer has quarantined them
        assert sorted(tier.quarantined_keys()) == sorted(k for k, _, _ in victims)
        assert tier.statistics().as_dict()["quarantined"] == len(victims)
        assert set(await tier.list_keys()) == {k for k, _, _ in control}
        assert await tier.contains_many([victims[0][0]]) == [False]
        assert tier.verify().corrupt == []
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_corruption_injected_while_open_is_quarantined_and_reported(tmp_path: Path) -> None:
    items = [_item(i) for i in range(3)]
    removed: List[bytes] = []
    async with await LmdbTier.open(tmp_path / "c", max_quarantine_records=0) as tier:
        tier.subscribe_removals(lambda removals: removed.extend(r.key for r in removals))
        await tier.put_many(items)
        await asyncio.to_thread(corrupt_stored_record, tier, items[1][0])
        report = await asyncio.to_thread(tier.verify, quarantine=False)
        assert report.checked == 3 and report.ok == 2 and [k for k, _ in report.corrupt] == [items[1][0]]
        results = await _get(tier, items)
        assert [m is None for m, _ in results] == [False, True, False]
        await tier.flush()
        assert removed == [items[1][0]]
        assert tier.quarantined_keys() == []  # no room kept: deleted, still counted
        assert tier.statistics().as_dict()["quarantined"] == 1
        # A good record written again under the key is served.
        await tier.put_many([items[1]])
        await _assert_served(tier, items)


# ------------------------------------------------------------------------------- map and capacity


@pytest.mark.asyncio
async def test_map_grows_past_a_tiny_initial_map(tmp_path: Path) -> None:
    chunks = [_item(i, shape=(256 * 1024,), random=True) for i in range(16)]  # 16 x 256 KiB = 4 MiB
    # segments off: with them, records of 256 KiB go to segment files and never grow the map
    async with await LmdbTier.open(tmp_path / "c", map_size_bytes=1 << 20, segment_threshold_bytes=None) as tier:
        for i in range(0, 8, 2):
            await tier.put_many(chunks[i : i + 2])
        await tier.put_many(chunks[8:])  # 2 MiB in one batch
        stats = tier.statistics().as_dict()
        assert stats["map_growths"] >= 2 and stats["map_size_bytes"] > 4 << 20
        assert not tier.degraded
        await _assert_served(tier, chunks)
    async with await LmdbTier.open(tmp_path / "c", map_size_bytes=1 << 20) as tier:
        await _assert_served(tier, chunks)


@pytest.mark.asyncio
async def test_lfuda_capacity_eviction_keeps_the_record_read_most(tmp_path: Path) -> None:
    """Records read again outlive newer ones read once (LRU would evict the old favourite first),
    every eviction is reported, the bound holds; an unknown policy name lists the valid ones."""
    cap = 1 << 20
    items = [_item(i, shape=(100 * 1024,), random=True) for i in range(12)]
    removed: List[bytes] = []
    async with await LmdbTier.open(tmp_path / "c", capacity_bytes=cap, eviction_policy="lfuda") as tier:
        tier.subscribe_removals(lambda removals: removed.extend(r.key for r in removals))
        await tier.put_many([items[0]])
        for it in items[1:4]:  # record 0 read three times (reads apply at the next write)
            await _get(tier, [items[0]])
            await tier.put_many([it])
        await _get(tier, items[1:4])  # 1, 2, 3 read once, after 0's last read
        for it in items[4:10]:  # 10 records fit
            await tier.put_many([it])
        await tier.put_many([items[10]])
        await tier.put_many([items[11]])
        present = await tier.contains_many([it[0] for it in items])
        # LRU would evict 0 and 1 (the least recently read); LFU-DA the unread 4 and 5.
        assert present == [True] * 4 + [False, False] + [True] * 6
        assert removed == [items[4][0], items[5][0]]
        assert tier.statistics().as_dict()["bytes"] <= cap
        assert await tier.check() == []
    with pytest.raises(ValueError, match=r"unknown disk eviction policy 'arc'; valid names: 'arc-lfuda', 'lfuda', 'lru'"):
        LmdbTier(tmp_path / "d", eviction_policy="arc")
    assert not (tmp_path / "d").exists()


@pytest.mark.asyncio
async def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    cap = 1 << 20
    items = [_item(i, shape=(100 * 1024,), random=True) for i in range(14)]
    size = len(encode_record(items[0][0], items[0][1], items[0][2]))
    removed: List[bytes] = []
    path = tmp_path / "c"
    async with await LmdbTier.open(path, capacity_bytes=cap) as tier:
        tier.subscribe_removals(lambda removals: removed.extend(r.key for r in removals))
        for it in items[:10]:  # 10 records fit
            await tier.put_many([it])
        assert tier.statistics().as_dict()["bytes"] == 10 * size <= cap
        await _get(tier, [items[0]])  # record 0 becomes the most recently used
        await tier.put_many([items[10]])
        await tier.put_many([items[11]])
        present = await tier.contains_many([it[0] for it in items[:12]])
        assert present == [True, False, False] + [True] * 9  # 1 and 2 were least recently used
        assert removed == [items[1][0], items[2][0]]
        stats = tier.statistics().as_dict()
        assert stats["evictions"] == 2 and stats["bytes"] <= cap

        with pytest.raises(TierFullError):
            await tier.put_many([_item(50 + i, shape=(100 * 1024,), random=True) for i in range(11)])
        assert not tier.degraded  # a batch too large is the caller's problem, not the disk's

    # The order survives a restart (access times are persisted): 3 is now the oldest.
    async with await LmdbTier.open(path, capacity_bytes=cap) as tier:
        await tier.put_many([items[12]])
        assert await tier.contains_many([items[3][0], items[0][0], items[12][0]]) == [False, True, True]
        assert await asyncio.to_thread(tier.gc, 5 * size) == 5
        assert tier.statistics().as_dict()["bytes"] == 5 * size
        assert await tier.contains_many([items[4][0], items[12][0]]) == [False, True]
        assert await tier.check() == []
    assert (path / "data.mdb").stat().st_size < 3 * cap


@pytest.mark.asyncio
async def test_a_key_read_again_before_the_writer_applies_reads_is_the_most_recent(tmp_path: Path) -> None:
    """Reads reach the LRU in batches (the writer applies them at its next write or timer tick): a
    key read, then another, then the first again, ends younger than the second, however the reads
    fall between two batches (its last read counts, never its first)."""
    cap = 1 << 20
    items = [_item(i, shape=(100 * 1024,), random=True) for i in range(12)]
    removed: List[bytes] = []
    async with await LmdbTier.open(tmp_path / "c", capacity_bytes=cap, access_flush_interval_s=3600.0) as tier:
        tier.subscribe_removals(lambda removals: removed.extend(r.key for r in removals))
        for it in items[:10]:  # 10 records fit
            await tier.put_many([it])
        for it in (items[0], items[1], items[0]):  # one batch of reads: 0, 1, 0
            await _get(tier, [it])
        await tier.flush()
        await tier.put_many([items[10]])
        await tier.put_many([items[11]])
        assert removed == [items[2][0], items[3][0]]  # 0 and 1 were read; 1 before 0's last read
        await tier.put_many([_item(20 + i, shape=(100 * 1024,), random=True) for i in range(8)])  # 4..9, then 1, then 0
        assert removed[-2:] == [items[1][0], items[0][0]]


# --------------------------------------------------------------------------------- directory safety


@pytest.mark.asyncio
async def test_directory_is_created_private_and_unsafe_ones_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "cache"
    async with await LmdbTier.open(path) as tier:
        assert tier.path == path.resolve()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((path / "data.mdb").stat().st_mode) & 0o077 == 0

    open_dir = tmp_path / "world"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeDirectoryError, match="world-writable"):
        await LmdbTier.open(open_dir)
    assert not (open_dir / "data.mdb").exists()

    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    with pytest.raises(UnsafeDirectoryError):
        await LmdbTier.open(not_a_dir)

    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
            await LmdbTier.open(foreign)

    with pytest.raises(TierIOError):
        await LmdbTier.open(tmp_path / "missing", readonly=True)


@pytest.mark.asyncio
async def test_argument_validation_and_double_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        LmdbTier(tmp_path / "x", capacity_bytes=0)
    with pytest.raises(ValueError, match="map_size_bytes"):
        LmdbTier(tmp_path / "x", map_size_bytes=1000)
    with pytest.raises(ValueError, match="read_workers"):
        LmdbTier(tmp_path / "x", read_workers=0)
    async with await LmdbTier.open(tmp_path / "c") as tier:
        with pytest.raises(ValueError, match="already open in this process"):
            await LmdbTier.open(tmp_path / "c")
        with pytest.raises(ValueError, match=r"chunk key length must be 1\.\.511, got 0"):
            await tier.put_many([(b"", _item(0)[1], _item(0)[2])])
    # Closed means the directory can be opened again.
    async with await LmdbTier.open(tmp_path / "c"):
        pass


# ------------------------------------------------------------------------------------------- reopen


@pytest.mark.asyncio
async def test_reopen_after_close_serves_the_same_bytes(tmp_path: Path) -> None:
    items = [_item(i, dt) for i, dt in enumerate([torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])]
    tier = await LmdbTier.open(tmp_path / "c")
    await tier.put_many(items)
    await tier.close()
    await tier.close()  # twice is fine
    with pytest.raises(ClosedError):
        await tier.get_many_into([(items[0][0], _buf(items[0]))])
    with pytest.raises(ClosedError):
        await tier.put_many(items)

    async with await LmdbTier.open(tmp_path / "c") as again:
        await _assert_served(again, items)
        stats = again.statistics().as_dict()
        assert stats["records"] == 4
        infos = list(again.iter_records())
        assert sorted(i.key for i in infos) == sorted(it[0] for it in items)
        assert all(i.header is not None and i.atime_ns > 0 for i in infos)

    async with await LmdbTier.open(tmp_path / "c", readonly=True) as ro:
        await _assert_served(ro, items)
        with pytest.raises(TierIOError, match="read-only"):
            await ro.put_many(items[:1])


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from kvtier.tiers.lmdb import LmdbTier

    async def main(path, key_hex, size, expected_hex, readonly):
        async with await LmdbTier.open(path, readonly=readonly == "1") as tier:
            buf = bytearray(int(size))
            [meta] = await tier.get_many_into([(bytes.fromhex(key_hex), memoryview(buf))])
            assert meta is not None, "record not found"
            assert buf.hex() == expected_hex, "bytes differ"
            print("ok", meta.chunk_index, len(await tier.list_keys()))

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.mark.asyncio
async def test_second_process_reads_without_corrupting(tmp_path: Path) -> None:
    items = [_item(i) for i in range(5)]
    async with await LmdbTier.open(tmp_path / "c") as tier:
        await tier.put_many(items)
        key, meta, raw = items[3]
        for readonly in ("1", "0"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _CHILD,
                str(tmp_path / "c"),
                key.hex(),
                str(raw.nbytes),
                raw.hex(),
                readonly,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            assert out.decode().split() == ["ok", "3", "5"]
        # Still intact and writable here.
        await _assert_served(tier, items)
        await tier.put_many([_item(9)])
        report = await asyncio.to_thread(tier.verify)
        assert report.checked == 6 and report.ok == 6


_WRITER_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from kvtier.tiers.base import ChunkMeta
    from kvtier.tiers.lmdb import LmdbTier

    async def main(path, key_hex):
        async with await LmdbTier.open(path) as tier:
            data = bytearray(b"x" * 64)
            meta = ChunkMeta(b"child", 0, 7, "uint8", (64,))
            print(await tier.put_many([(bytes.fromhex(key_hex), meta, memoryview(data))]))

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.mark.asyncio
async def test_the_sequence_orders_other_processes_writes(tmp_path: Path) -> None:
    """The sequence lives in the environment: a write by another process gets the next one, a
    snapshot sees it, and this process's next put is ordered after it."""
    async with await LmdbTier.open(tmp_path / "c") as tier:
        mine = await tier.put_many([_item(1)])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WRITER_CHILD, str(tmp_path / "c"), _key(2).hex(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        theirs = int(out.decode())
        assert theirs > mine
        snap = await tier.snapshot_keys()
        assert snap.keys == {_key(1), _key(2)} and snap.sequence >= theirs
        assert await tier.put_many([_item(3)]) > theirs
    async with await LmdbTier.open(tmp_path / "c") as again:  # persisted with the data
        assert again.sequence > theirs


# ------------------------------------------------------------------------------------- concurrency


@pytest.mark.asyncio
async def test_hundreds_of_concurrent_puts_and_gets(tmp_path: Path) -> None:
    items = [_item(i, shape=(8, 1000 + i)) for i in range(300)]
    async with await LmdbTier.open(tmp_path / "c", read_workers=2) as tier:
        await asyncio.gather(*(tier.put_many([it]) for it in items[:200]))
        stats = tier.statistics().as_dict()
        assert stats["puts"] == 200 and stats["put_commits"] < 200  # batches were committed together

        async def get_one(it: Item) -> None:
            [(meta, data)] = await _get(tier, [it])
            assert meta == it[1] and data == it[2].tobytes()

        await asyncio.gather(
            *(get_one(it) for it in items[:200]),
            *(tier.put_many([it]) for it in items[200:]),
        )
        assert len(await tier.list_keys()) == 300
        await _assert_served(tier, items)
        assert tier.statistics().as_dict()["errors"] == 0
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_cancelled_callers_do_not_break_the_writer(tmp_path: Path) -> None:
    big = [_item(1000 + i, shape=(1 << 20,), random=True) for i in range(6)]
    small = [_item(i) for i in range(10)]
    async with await LmdbTier.open(tmp_path / "c") as tier:
        for _ in range(3):
            task = asyncio.create_task(tier.put_many(big))
            await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            get_task = asyncio.create_task(tier.get_many_into([(it[0], _buf(it)) for it in big]))
            await asyncio.sleep(0)
            get_task.cancel()
        await tier.flush()
        await tier.put_many(small)
        await _assert_served(tier, small)
        present = await tier.contains_many([it[0] for it in big])
        assert len(set(present)) == 1  # the cancelled batch landed whole or not at all
        assert tier.statistics().as_dict()["errors"] == 0
        assert await tier.check() == []


# --------------------------------------------------------------------------------------- disk full


def _mount_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("disk-full test needs root to mount a small tmpfs; running as uid %d" % os.geteuid())
    if shutil.which("mount") is None:
        pytest.skip("disk-full test needs the mount command")
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")


def _fill(path: Path) -> None:
    with open(path, "wb") as f:
        block = b"\0" * 65536
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        # Leave whatever partial block did not fit: the filesystem is now full.


@pytest.mark.asyncio
async def test_disk_full_is_typed_degrades_and_recovers(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "8m")
    try:
        early = [_item(i, shape=(256 * 1024,), random=True) for i in range(4)]  # 1 MiB
        later = [_item(100 + i, shape=(256 * 1024,), random=True) for i in range(4)]
        async with await LmdbTier.open(mnt / "cache", map_size_bytes=64 << 20) as tier:
            await tier.put_many(early)
            ballast = mnt / "ballast"
            _fill(ballast)
            with pytest.raises(TierFullError) as info:
                await tier.put_many(later)
            assert info.value.__cause__ is not None
            assert tier.degraded and tier.statistics().as_dict()["degraded"] == 1.0
            await _assert_served(tier, early)  # reads keep working while degraded
            assert await tier.contains_many([later[0][0]]) == [False]  # all or nothing

            ballast.unlink()  # space returns
            await tier.put_many(later)
            assert not tier.degraded
            await _assert_served(tier, early + later)
            assert await tier.check() == []
        async with await LmdbTier.open(mnt / "cache") as tier:
            await _assert_served(tier, early + later)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -------------------------------------------------------------------------------------- fork safety


@pytest.mark.asyncio
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
async def test_forked_child_cannot_use_the_parent_tier(tmp_path: Path) -> None:
    async with await LmdbTier.open(tmp_path / "c") as tier:
        await tier.put_many([_item(0)])
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: only touches the guard, then leaves without cleanup
            code = 1
            try:
                asyncio.new_event_loop().run_until_complete(tier.contains_many([_key(0)]))
            except ForkedProcessError:
                code = 0
            except BaseException:
                code = 2
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        result = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert result == b"\0"
        assert await tier.contains_many([_key(0)]) == [True]


@pytest.mark.asyncio
async def test_timer_persists_access_times(tmp_path: Path) -> None:
    it = _item(0)
    async with await LmdbTier.open(
        tmp_path / "c", reader_check_interval_s=0.05, access_flush_interval_s=0.05
    ) as tier:
        await tier.put_many([it])
        [before] = list(tier.iter_records())
        await asyncio.sleep(0.01)
        await _get(tier, [it])
        for _ in range(100):
            await asyncio.sleep(0.02)
            [after] = list(tier.iter_records())
            if after.atime_ns > before.atime_ns:
                break
        assert after.atime_ns > before.atime_ns
