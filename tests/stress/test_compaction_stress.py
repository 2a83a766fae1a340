"""Stress: segment compaction under concurrent puts, overwrites, deletes and reads (opt-in:
``python3 -m pytest tests/stress -s -k compaction --compaction-seconds 60 --fault-seed N``).

Each writer coroutine owns its keys, so a dict per writer is the exact model: after every operation
the key reads back bitwise (or misses, when deleted). Meanwhile automatic passes run after the
deletes and overwrites, and one coroutine calls ``compact_segments`` in a loop, so moves, retired
sources and reads interleave freely. Not one read of a live key may miss. Ends with the self-checks:
``check()``, ``verify()``, the ``segments`` table equal to the pointers, and after a reopen every
record bitwise and the segment files exactly their committed bytes."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Dict

import pytest

from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.lmdb.segments import committed_ends
from kvtier.tiers.record_format import CodecConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from segment_checks import assert_ledger_matches, segment_files  # noqa: E402

pytestmark = pytest.mark.stress

OPTIONS = dict(segment_threshold_bytes=16 << 10, segment_max_bytes=1 << 20, codec=CodecConfig(compress=False))


async def _check_key(tier: LmdbTier, key: bytes, model: Dict[bytes, bytes], where: str) -> None:
    want = model.get(key)
    buf = bytearray(len(want) if want is not None else 1)
    (meta,) = await tier.get_many_into([(key, memoryview(buf))])
    if want is None:
        assert meta is None, f"{where}: deleted key {key.hex()} still served"
    else:
        assert meta is not None, f"{where}: live key {key.hex()} missed"
        assert bytes(buf) == want, f"{where}: key {key.hex()} served other bytes"


def test_compaction_under_concurrent_churn(tmp_path: Path, compaction_seconds: float, fault_seed: int) -> None:
    asyncio.run(_churn(tmp_path / "c", compaction_seconds, fault_seed))


async def _churn(path: Path, seconds: float, seed: int) -> None:
    models = [dict() for _ in range(4)]  # type: ignore[var-annotated]
    deadline = time.monotonic() + seconds
    ops = 0

    async def writer(lane: int, tier: LmdbTier) -> None:
        nonlocal ops
        rng = random.Random(seed * 31 + lane)
        keys = [bytes([lane]) * 8 + i.to_bytes(8, "little") for i in range(48)]
        model: Dict[bytes, bytes] = models[lane]
        while time.monotonic() < deadline:
            key = rng.choice(keys)
            if rng.random() < 0.65:
                raw = rng.randbytes(rng.choice([4000, 30_000, 70_000, 150_000]))
                await tier.put_many([(key, ChunkMeta(b"fp", lane, 0, "uint8", (len(raw),)), memoryview(raw))])
                model[key] = raw
            else:
                await tier.delete_many([key])
                model.pop(key, None)
            await _check_key(tier, key, model, f"lane {lane} op {ops}")
            await _check_key(tier, rng.choice(keys), model, f"lane {lane} op {ops} (another key)")
            ops += 1

    async def compactor(tier: LmdbTier) -> int:
        moved = 0
        while time.monotonic() < deadline:
            moved += (await tier.compact_segments()).records
            await asyncio.sleep(0.05)
        return moved

    async with await LmdbTier.open(path, **OPTIONS) as tier:
        results = await asyncio.gather(*(writer(lane, tier) for lane in range(4)), compactor(tier))
        await tier.flush()
        stats = tier.statistics()
        assert stats.corrupt == 0
        assert await tier.check() == []
        assert tier.verify().corrupt == []
        assert_ledger_matches(tier)
        extra = stats.extra
    print(f"\ncompaction stress (seed {seed}): {ops} operations in {seconds:.0f} s, {results[-1]} records moved by "
          f"explicit passes, {int(extra['compacted_records'])} in all, {int(extra['compacted_segments'])} segment "
          f"files freed, {int(extra['compaction_passes'])} passes, 0 misses of live keys")
    async with await LmdbTier.open(path, **OPTIONS) as tier:
        for lane, model in enumerate(models):
            for key in model:
                await _check_key(tier, key, model, f"after reopen, lane {lane}")
        ends = tier._db.read_txn(lambda txn: committed_ends(txn, tier._db.tables.segments))
        assert segment_files(path) == ends
        assert await tier.check() == []
