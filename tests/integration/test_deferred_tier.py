"""``DeferredTier`` while its tier is opening (the contract suite's ``deferred-lmdb`` covers it once
open): reads miss, writes wait for the open and then land, a subscription made meanwhile hears the
tier's removals, and an open that fails is the writes' typed error, never a hang."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvtier.errors import TierIOError
from kvtier.tiers.base import ChunkMeta, ChunkTier, Removal
from kvtier.tiers.deferred import DeferredTier
from kvtier.tiers.lmdb import LmdbTier

META = ChunkMeta(b"deferred", 0, 0, "uint8", (512,))


async def open_after(gate: asyncio.Event, path: Path) -> ChunkTier:
    await gate.wait()
    return await LmdbTier.open(path, segment_threshold_bytes=None, map_size_bytes=8 << 20)


@pytest.mark.asyncio
async def test_reads_miss_and_writes_wait_until_the_tier_is_open(tmp_path: Path) -> None:
    gate = asyncio.Event()
    tier = DeferredTier(asyncio.ensure_future(open_after(gate, tmp_path / "kv")), name="lmdb")
    removed: list = []
    tier.subscribe_removals(lambda removals: removed.extend(removals))
    key, payload = os.urandom(32), os.urandom(512)
    out = bytearray(512)
    assert await tier.get_many_into([(key, memoryview(out))]) == [None]
    assert await tier.contains_many([key]) == [False]
    assert tier.statistics().records == 0 and tier.sequence == 0 and tier.opened is None
    with pytest.raises(TypeError):
        await tier.put_many([("not bytes", META, memoryview(payload))])  # type: ignore[list-item]
    put = asyncio.ensure_future(tier.put_many([(key, META, memoryview(payload))]))
    await asyncio.sleep(0.05)
    assert not put.done()  # waits for the open
    gate.set()
    sequence = await put
    assert isinstance(tier.opened, LmdbTier) and sequence == tier.sequence > 0
    assert await tier.get_many_into([(key, memoryview(out))]) == [META] and bytes(out) == payload
    assert tier.path == tmp_path / "kv"  # the tier's own attributes, once open
    assert await tier.delete_many([key]) == 1
    await tier.flush()
    await asyncio.sleep(0)
    assert [(r.key, r.reason) for r in removed] == [(key, "deleted")] and isinstance(removed[0], Removal)
    await tier.close()
    assert tier.closed and tier.opened is not None and tier.opened.closed


@pytest.mark.asyncio
async def test_an_open_that_failed_is_the_writes_typed_error_and_reads_stay_misses(tmp_path: Path) -> None:
    async def fails() -> ChunkTier:
        raise OSError("injected: the disk went away")

    tier = DeferredTier(asyncio.ensure_future(fails()), name="lmdb")
    with pytest.raises(TierIOError, match="did not open") as caught:
        await tier.put_many([(b"k", META, memoryview(bytes(512)))])
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(TierIOError):
        await tier.list_keys()
    assert await tier.get_many_into([(b"k", memoryview(bytearray(512)))]) == [None]
    await tier.close()
    assert tier.closed
