"""Integration tests of the file tier (tiers/files/) on real files.

Scenarios are narrated and tiny (a few KiB per record, capacities of a few records), except the
disk-full one, which needs root to mount a 2 MiB tmpfs and is skipped, with the reason, otherwise.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import subprocess
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional

import pytest
import torch

from kvtier.errors import ClosedError, TierFullError, UnsafeDirectoryError
from kvtier.tiers.base import KEY_MAX_BYTES, ChunkMeta
from kvtier.tiers.files import layout as files_layout
from kvtier.tiers.files import QUARANTINE_DIR, RECORD_SUFFIX, TEMP_SUFFIX, FileTier
from kvtier.tiers.quarantine import DEFAULT_MAX_QUARANTINE_RECORDS
from kvtier.tiers.record_format import CodecConfig, encode_record, read_header

FP = b"test-layout-fp-v1"


def key_of(i: int, tag: bytes = b"k") -> bytes:
    # Keys are 32 bytes like the policy's BLAKE3 keys, but deliberately non-uniform (mostly zero)
    # so that the fan-out is shown to come from hashing, not from the key's own leading bytes.
    return tag + b"\x00" * (27 - len(tag)) + i.to_bytes(5, "big")


def meta_for(t: torch.Tensor, chunk_index: int = 0, group_index: int = 0) -> ChunkMeta:
    return ChunkMeta(
        fingerprint=FP,
        group_index=group_index,
        chunk_index=chunk_index,
        dtype=str(t.dtype).removeprefix("torch."),
        shape=tuple(t.shape),
    )


def raw_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def record_files(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*" + RECORD_SUFFIX) if QUARANTINE_DIR not in p.parts)


def temp_files(root: Path) -> List[Path]:
    return sorted(root.rglob("*" + TEMP_SUFFIX))


@asynccontextmanager
async def opened(root: Path, **kwargs: object) -> AsyncIterator[FileTier]:
    tier = await FileTier.open(root, **kwargs)  # type: ignore[arg-type]
    try:
        yield tier
        assert await tier.check() == []
    finally:
        await tier.close()


async def put_bytes(tier: FileTier, key: bytes, data: torch.Tensor, chunk_index: int = 0) -> None:
    await tier.put_many([(key, meta_for(data, chunk_index), raw_of(data))])


async def get_bytes(tier: FileTier, key: bytes, nbytes: int) -> Optional[bytes]:
    out = torch.empty(nbytes, dtype=torch.uint8)
    (meta,) = await tier.get_many_into([(key, memoryview(out.numpy()))])
    return None if meta is None else out.numpy().tobytes()


# ------------------------------------------------------------------------------------ round trip


@pytest.mark.asyncio
@pytest.mark.parametrize("compress", [True, False], ids=["zstd-planes", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
async def test_bitwise_round_trip_odd_shapes(tmp_path: Path, dtype: torch.dtype, compress: bool) -> None:
    g = torch.Generator().manual_seed(7)
    shapes = [(3, 5, 7), (1, 13), (2, 3, 17, 5), (7, 33, 65), (1,)]
    tensors = [torch.randn(s, generator=g).mul(3).to(dtype) for s in shapes]
    # NaN, infinities (where the dtype has them), signed zero: bitwise, not numeric, equality.
    specials = torch.tensor([float("nan"), -0.0, 0.0, 1e-30, -448.0, 448.0]).to(dtype)
    tensors.append(specials)
    keys = [key_of(i) for i in range(len(tensors))]
    async with opened(tmp_path / "c", codec=CodecConfig(compress=compress)) as tier:
        await tier.put_many(
            [(k, meta_for(t, i), raw_of(t)) for i, (k, t) in enumerate(zip(keys, tensors))]
        )
        outs = [torch.empty_like(t) for t in tensors]
        metas = await tier.get_many_into([(k, raw_of(o)) for k, o in zip(keys, outs)])
        for i, (t, o, m) in enumerate(zip(tensors, outs, metas)):
            assert m == meta_for(t, i)
            assert torch.equal(o.view(torch.uint8), t.view(torch.uint8)), f"shape {t.shape}"
        if compress and dtype in (torch.bfloat16, torch.float16):
            # The big tensor's high bytes compress: the byte-plane codec really was exercised.
            assert read_header(tier.path_for(keys[3]).read_bytes()).codec == "zstd-planes"
        stats = tier.statistics().as_dict()
        assert stats["records"] == len(tensors) and stats["hits"] == len(tensors)
        assert stats["bytes"] == sum(p.stat().st_size for p in record_files(tier.root))


@pytest.mark.asyncio
async def test_missing_key_and_wrong_buffer_size_are_misses_without_quarantine(tmp_path: Path) -> None:
    data = random_bytes(1000, 1)
    async with opened(tmp_path / "c") as tier:
        await put_bytes(tier, key_of(1), data)
        assert await get_bytes(tier, key_of(2), 1000) is None
        # An intact record asked for with the wrong size: a miss, and it stays for correct callers.
        assert await get_bytes(tier, key_of(1), 999) is None
        assert tier.path_for(key_of(1)).exists()
        assert await get_bytes(tier, key_of(1), 1000) == data.numpy().tobytes()
        stats = tier.statistics().as_dict()
        assert (stats["misses"], stats["mismatched"], stats["corrupt"]) == (2, 1, 0)


# -------------------------------------------------------------------------------------- layout


@pytest.mark.asyncio
async def test_fan_out_layout_and_modes(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    keys = [key_of(i) for i in range(64)]
    async with opened(root) as tier:
        await tier.put_many([(k, meta_for(random_bytes(256, i)), raw_of(random_bytes(256, i))) for i, k in enumerate(keys)])
        for k in keys:
            p = tier.path_for(k)
            rel = p.relative_to(root).parts
            assert len(rel) == 3 and rel[2] == k.hex() + RECORD_SUFFIX
            assert all(len(d) == 2 and int(d, 16) >= 0 for d in rel[:2])
            assert p.is_file() and stat.S_IMODE(p.stat().st_mode) == 0o600
            assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700
            assert stat.S_IMODE(p.parent.parent.stat().st_mode) == 0o700
        # Keys that share 27 leading bytes still spread: the directories come from a hash.
        assert len({tier.path_for(k).parent for k in keys}) > 48
        assert {p for p in record_files(root)} == {tier.path_for(k) for k in keys}
        assert temp_files(root) == []
        assert sorted(await tier.list_keys()) == sorted(keys)
        assert await tier.contains_many([keys[0], key_of(999)]) == [True, False]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / QUARANTINE_DIR).stat().st_mode) == 0o700


# -------------------------------------------------------------------------------------- safety


@pytest.mark.asyncio
async def test_unsafe_directories_are_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeDirectoryError, match="world-writable"):
        await FileTier.open(shared)
    os.chmod(shared, 0o700)
    if os.geteuid() == 0:
        os.chown(shared, 65534, 65534)
        with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
            await FileTier.open(shared)
        os.chown(shared, 0, 0)
    tier = await FileTier.open(shared)
    await tier.close()


# ---------------------------------------------------------------------------------- corruption


@pytest.mark.asyncio
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd-planes"])
async def test_every_flipped_byte_is_detected_quarantined_and_counted(
    tmp_path: Path, compress: bool
) -> None:
    # bf16 values with a narrow exponent range: the high plane compresses, so with compress=True
    # the payload holds a zstd frame and a raw plane, each of which gets flipped below.
    data = (torch.randn(8, 24, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16)
    meta = meta_for(data)
    codec = CodecConfig(compress=compress)
    root = tmp_path / "c"
    async with opened(root, codec=codec) as tier:
        await tier.put_many([(key_of(0), meta, raw_of(data))])
        pristine = tier.path_for(key_of(0)).read_bytes()
        # The file is exactly the record, nothing around it.
        assert pristine == encode_record(key_of(0), meta, raw_of(data), codec)
        header = read_header(pristine)
        assert header.codec == ("zstd-planes" if compress else "raw")
    payload_start = len(pristine) - header.payload_length
    n = len(pristine)
    # One record per byte position (every prefix, header, checksum and payload byte), each
    # under its own key and with position i of record i flipped. They are planted as files
    # (no fsync, so the test stays fast) and picked up by the scan of the next open.
    keys = [key_of(i, b"flip") for i in range(n)]
    classes: Dict[str, int] = {"prefix": 0, "header": 0, "payload": 0}
    for i, k in enumerate(keys):
        b = bytearray(encode_record(k, meta, raw_of(data), codec))
        b[i] ^= 0x01 if i % 2 else 0xFF
        p = tier.path_for(k)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes(b))
        classes["prefix" if i < 10 else "header" if i < payload_start else "payload"] += 1
    assert all(v > 0 for v in classes.values()), classes
    # Truncated and extended records are corrupt too.
    for k, mutate in [(key_of(1), lambda b: b[:-1]), (key_of(2), lambda b: b + b"\0")]:
        tier.path_for(k).parent.mkdir(parents=True, exist_ok=True)
        tier.path_for(k).write_bytes(mutate(encode_record(k, meta, raw_of(data), codec)))
    bad = keys + [key_of(1), key_of(2)]
    async with opened(root, codec=codec) as tier:
        assert await tier.contains_many(bad) == [True] * len(bad)  # the scan does not decode
        outs = [torch.empty_like(data) for _ in bad]
        metas = await tier.get_many_into([(k, raw_of(o)) for k, o in zip(bad, outs)])
        assert metas == [None] * len(bad)
        stats = tier.statistics().as_dict()
        assert stats["corrupt"] == len(bad) and stats["misses"] == len(bad)
        assert await tier.contains_many(bad) == [False] * len(bad)
        assert not any(tier.path_for(k).exists() for k in bad)
        quarantined = list((tier.root / QUARANTINE_DIR).iterdir())
        assert len(quarantined) == min(len(bad), DEFAULT_MAX_QUARANTINE_RECORDS)
        # The intact record next to them is still served, bit for bit.
        out = torch.empty_like(data)
        assert await tier.get_many_into([(key_of(0), raw_of(out))]) == [meta]
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))
        # A quarantined key can be stored again.
        await tier.put_many([(keys[0], meta, raw_of(data))])
        assert await tier.get_many_into([(keys[0], raw_of(out))]) == [meta]


@pytest.mark.asyncio
async def test_record_renamed_to_another_key_is_corrupt(tmp_path: Path) -> None:
    data = random_bytes(512, 5)
    async with opened(tmp_path / "c") as tier:
        await put_bytes(tier, key_of(1), data)
        await put_bytes(tier, key_of(2), random_bytes(512, 6))
        # A valid record under the wrong name (a swapped file): the checksum covers the key.
        os.replace(tier.path_for(key_of(1)), tier.path_for(key_of(2)))
        assert await get_bytes(tier, key_of(2), 512) is None
        assert tier.statistics().as_dict()["corrupt"] == 1
        assert await get_bytes(tier, key_of(1), 512) is None  # file gone: a plain miss
        assert tier.statistics().as_dict()["corrupt"] == 1


# ------------------------------------------------------------------------------------ capacity


@pytest.mark.asyncio
async def test_capacity_evicts_least_recently_read(tmp_path: Path) -> None:
    size = 4096
    blobs = {name: random_bytes(size, i) for i, name in enumerate("ABCDEF")}
    keys = {name: key_of(i, b"cap") for i, name in enumerate("ABCDEF")}
    async with opened(tmp_path / "c", capacity_bytes=1) as probe:
        with pytest.raises(TierFullError, match="exceeds the capacity"):
            await put_bytes(probe, keys["A"], blobs["A"])
        assert await probe.list_keys() == []
    async with opened(tmp_path / "probe") as probe:
        await put_bytes(probe, keys["A"], blobs["A"])
        record_size = int(probe.statistics().as_dict()["bytes"])
    capacity = record_size * 3 + record_size // 2  # room for three records
    async with opened(tmp_path / "c2", capacity_bytes=capacity) as tier:
        for name in "ABC":
            await put_bytes(tier, keys[name], blobs[name])
        # Reading A makes B the least recently used.
        assert await get_bytes(tier, keys["A"], size) == blobs["A"].numpy().tobytes()
        await put_bytes(tier, keys["D"], blobs["D"])
        assert await tier.contains_many([keys[n] for n in "ABCD"]) == [True, False, True, True]
        assert not tier.path_for(keys["B"]).exists()
        # Now C is the oldest.
        await put_bytes(tier, keys["E"], blobs["E"])
        assert await tier.contains_many([keys[n] for n in "ACDE"]) == [True, False, True, True]
        stats = tier.statistics().as_dict()
        assert stats["evictions"] == 2 and stats["records"] == 3
        on_disk = sum(p.stat().st_size for p in record_files(tier.root))
        assert on_disk == stats["bytes"] <= capacity
        # A batch of two evicts the two oldest (A, then D) in one go, atomically.
        await tier.put_many(
            [(keys[n], meta_for(blobs[n]), raw_of(blobs[n])) for n in "BF"]
        )
        assert sorted(await tier.list_keys()) == sorted(keys[n] for n in "EBF")
        # A batch larger than the whole capacity is refused and changes nothing.
        with pytest.raises(TierFullError):
            await tier.put_many(
                [(key_of(100 + i), meta_for(blobs["A"]), raw_of(blobs["A"])) for i in range(4)]
            )
        assert sorted(await tier.list_keys()) == sorted(keys[n] for n in "EBF")
        assert temp_files(tier.root) == []
    # A reopen with a smaller capacity trims to it, least recently used first.
    async with opened(tmp_path / "c2", capacity_bytes=record_size) as tier:
        assert tier.statistics().as_dict()["records"] == 1
        assert len(record_files(tier.root)) == 1


# -------------------------------------------------------------------------------------- reopen


@pytest.mark.asyncio
async def test_reopen_serves_same_bytes_and_rebuilds_index(tmp_path: Path) -> None:
    root = tmp_path / "c"
    tensors = {key_of(i): torch.randn(5, 17).to(torch.bfloat16) for i in range(20)}
    async with opened(root) as tier:
        await tier.put_many([(k, meta_for(t, i), raw_of(t)) for i, (k, t) in enumerate(tensors.items())])
        assert await tier.delete_many([key_of(0), key_of(1), key_of(999)]) == 2
        before = tier.statistics().as_dict()
    del tensors[key_of(0)], tensors[key_of(1)]
    async with opened(root) as tier:
        assert sorted(await tier.list_keys()) == sorted(tensors)
        stats = tier.statistics().as_dict()
        assert (stats["records"], stats["bytes"]) == (before["records"], before["bytes"])
        outs = {k: torch.empty_like(t) for k, t in tensors.items()}
        metas = await tier.get_many_into([(k, raw_of(o)) for k, o in outs.items()])
        assert all(m is not None for m in metas)
        for k, t in tensors.items():
            assert torch.equal(outs[k].view(torch.uint8), t.view(torch.uint8))


@pytest.mark.asyncio
async def test_long_keys_nest_under_their_fan_out_and_survive_a_reopen(tmp_path: Path) -> None:
    """Keys past 100 bytes (up to the contract's 511) do not fit one file name: their hex goes over
    ``<200 digits>.k`` directory levels; the scan at open finds them again."""
    root = tmp_path / "c"
    keys = [bytes([7]) * 100, bytes([8]) * 101, bytes(range(256)) + bytes(range(255)), b"\x01"]
    assert len(keys[2]) == KEY_MAX_BYTES
    blobs = {k: random_bytes(300 + i, i) for i, k in enumerate(keys)}
    async with opened(root) as tier:
        for k, b in blobs.items():
            await put_bytes(tier, k, b)
        long_path = tier.path_for(keys[2])
        digits = keys[2].hex()
        parts = long_path.relative_to(root).parts
        assert parts[2:-1] == tuple(digits[i : i + 200] + ".k" for i in range(0, 1000, 200))
        assert parts[-1] == digits[1000:] + RECORD_SUFFIX and [len(p) for p in parts] == [2, 2] + [202] * 5 + [26]
        assert tier.path_for(keys[0]).relative_to(root).parts[2] == keys[0].hex() + RECORD_SUFFIX
    async with opened(root) as tier:
        assert sorted(await tier.list_keys()) == sorted(keys)
        for k, b in blobs.items():
            assert await get_bytes(tier, k, b.numel()) == b.numpy().tobytes()
        assert await tier.check() == []
        assert await tier.delete_many([keys[2]]) == 1 and not tier.path_for(keys[2]).exists()


@pytest.mark.asyncio
async def test_stale_temp_files_are_removed_at_open(tmp_path: Path) -> None:
    root = tmp_path / "c"
    data = random_bytes(300, 9)
    async with opened(root) as tier:
        await put_bytes(tier, key_of(1), data)
        leaf = tier.path_for(key_of(1)).parent
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no process (a crashed writer on this host)
    host = files_layout.HOST_TAG
    crashed = leaf / f".{key_of(2).hex()}.{host}-{dead.pid}-abcd1230{TEMP_SUFFIX}"
    crashed.write_bytes(b"half a record")
    ancient = leaf / f".{key_of(3).hex()}.otherhost-12-ab{TEMP_SUFFIX}"
    ancient.write_bytes(b"left by another host long ago")
    old = time.time() - 3600
    os.utime(ancient, (old, old))
    # Another host's write in flight right now: opening must not break its rename.
    live = leaf / f".{key_of(4).hex()}.otherhost-12-cd{TEMP_SUFFIX}"
    live.write_bytes(b"being written")
    async with opened(root) as tier:
        assert not crashed.exists() and not ancient.exists() and live.exists()
        assert tier.statistics().as_dict()["temps_removed"] == 2
        assert await tier.list_keys() == [key_of(1)]
        assert await get_bytes(tier, key_of(1), 300) == data.numpy().tobytes()
    live.unlink()


# --------------------------------------------------------------------------------- concurrency


@pytest.mark.asyncio
async def test_hundreds_of_concurrent_puts_and_gets_lose_nothing(tmp_path: Path) -> None:
    n = 200
    blobs = [random_bytes(2048 + i, i) for i in range(2 * n)]
    async with opened(tmp_path / "c") as tier:
        await asyncio.gather(*(put_bytes(tier, key_of(i), blobs[i], i) for i in range(n)))
        # Gets of the first half race with puts of the second half.
        got = await asyncio.gather(
            *(get_bytes(tier, key_of(i), blobs[i].numel()) for i in range(n)),
            *(put_bytes(tier, key_of(i), blobs[i], i) for i in range(n, 2 * n)),
        )
        assert all(got[i] == blobs[i].numpy().tobytes() for i in range(n))
        got = await asyncio.gather(*(get_bytes(tier, key_of(i), blobs[i].numel()) for i in range(2 * n)))
        assert all(g == b.numpy().tobytes() for g, b in zip(got, blobs))
        stats = tier.statistics().as_dict()
        assert stats["records"] == 2 * n and stats["errors"] == 0 and stats["puts"] == 2 * n
        assert temp_files(tier.root) == []


@pytest.mark.asyncio
async def test_cancelled_put_lands_all_or_nothing(tmp_path: Path) -> None:
    blobs = [random_bytes(64 << 10, i) for i in range(16)]
    tier = await FileTier.open(tmp_path / "c")
    try:
        task = asyncio.ensure_future(
            tier.put_many([(key_of(i), meta_for(b), raw_of(b)) for i, b in enumerate(blobs)])
        )
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await tier.close()  # waits for the batch, which still runs
    # The caller left, but the batch was already the tier's: it landed whole.
    assert len(record_files(tier.root)) == 16
    assert temp_files(tier.root) == []
    async with opened(tmp_path / "c") as tier:
        assert await tier.contains_many([key_of(i) for i in range(16)]) == [True] * 16


@pytest.mark.asyncio
async def test_close_is_idempotent_and_later_calls_raise(tmp_path: Path) -> None:
    tier = await FileTier.open(tmp_path / "c")
    await put_bytes(tier, key_of(1), random_bytes(10, 1))
    await tier.close()
    await tier.close()
    with pytest.raises(ClosedError):
        await tier.put_many([])
    with pytest.raises(ClosedError):
        await tier.get_many_into([])
    with pytest.raises(ClosedError):
        await tier.contains_many([key_of(1)])
    with pytest.raises(ClosedError):
        await tier.delete_many([key_of(1)])
    with pytest.raises(ClosedError):
        await tier.list_keys()
    assert tier.statistics().as_dict()["records"] == 1
    with pytest.raises(TypeError):
        FileTier(tmp_path, None, CodecConfig(), 1)


# ----------------------------------------------------------------------------------- disk full


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("disk-full test needs root to mount a 2 MiB tmpfs (running as uid %d)" % os.geteuid())
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.asyncio
async def test_disk_full_is_typed_and_recoverable(tiny_tmpfs: Path) -> None:
    size = 256 << 10
    root = tiny_tmpfs / "cache"
    blobs = [random_bytes(size, i) for i in range(16)]  # incompressible: records stay 256 KiB
    tier = await FileTier.open(root)
    try:
        stored: List[int] = []
        full: Optional[TierFullError] = None
        for i in range(len(blobs)):
            try:
                await put_bytes(tier, key_of(i), blobs[i])
            except TierFullError as exc:
                full = exc
                break
            stored.append(i)
        assert full is not None, "2 MiB tmpfs never filled up"
        assert isinstance(full.__cause__, OSError) and full.__cause__.errno == errno.ENOSPC
        failed = len(stored)
        assert 3 <= failed < len(blobs)
        assert tier.statistics().as_dict()["degraded"] == 1
        # Nothing partial is visible, and everything stored earlier still reads back bit for bit.
        assert await tier.contains_many([key_of(failed)]) == [False]
        assert not tier.path_for(key_of(failed)).exists()
        assert temp_files(root) == []
        for i in stored:
            assert await get_bytes(tier, key_of(i), size) == blobs[i].numpy().tobytes()
        # A batch that fits only partly: all or nothing.
        await tier.delete_many([key_of(stored[0])])
        batch = [failed, failed + 1, failed + 2]
        with pytest.raises(TierFullError):
            await tier.put_many([(key_of(i), meta_for(blobs[i]), raw_of(blobs[i])) for i in batch])
        assert await tier.contains_many([key_of(i) for i in batch]) == [False] * 3
        assert not any(tier.path_for(key_of(i)).exists() for i in batch)
        assert temp_files(root) == []
        # Space returns: writes succeed again.
        await tier.delete_many([key_of(i) for i in stored[1:4]])
        await tier.put_many([(key_of(i), meta_for(blobs[i]), raw_of(blobs[i])) for i in batch])
        for i in batch:
            assert await get_bytes(tier, key_of(i), size) == blobs[i].numpy().tobytes()
        assert tier.statistics().as_dict()["degraded"] == 0
        assert await tier.check() == []
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_delete_racing_a_put_of_the_same_key_keeps_index_and_disk_in_step(tmp_path: Path) -> None:
    blobs = [random_bytes(32 << 10, i) for i in range(8)]
    async with opened(tmp_path / "c") as tier:
        await tier.put_many([(key_of(i), meta_for(b), raw_of(b)) for i, b in enumerate(blobs)])
        put = asyncio.ensure_future(
            tier.put_many([(key_of(i), meta_for(b), raw_of(b)) for i, b in enumerate(blobs)])
        )
        await asyncio.sleep(0)
        assert await tier.delete_many([key_of(i) for i in range(8)]) == 8
        await put
        # The delete was ordered after the put: nothing left, on disk or in the index.
        assert await tier.list_keys() == []
        assert record_files(tier.root) == []
