"""Start-up does not wait for the listing of the disk's keys: a store (and the engine on it) serves
while the listing runs, on real LMDB, with the listing held inside the tier's read transaction by
the tier's own I/O hook (a real blocking point on the read thread, not a timing)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import AsyncIterator, List, Tuple

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.engine.config import StoreConfig
import kvtier.engine.store as store_module
from kvtier.engine.store import DiskStore
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.base import ChunkMeta, IOHook
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

from named_records import named_items, named_keys

FP = b"listing-test"
CHUNK = 256
# Far past any wait the test would accept: the hook holds the listing for good until released.
HELD_S = 30.0


class HeldListing(IOHook):
    """Holds the first read transaction (the listing's snapshot: the tier calls the hook inside the
    transaction, after its snapshot of the environment is taken) until ``release()``; every other
    operation passes. Runs on the tier's read thread."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        self._armed = True

    def before(self, op: str) -> None:
        if op == "read" and self._armed:
            self._armed = False
            self.entered.set()
            self._released.wait(HELD_S)

    def release(self) -> None:
        self._released.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, HELD_S), "the listing never reached the tier"


def items(names: List[str]) -> List[Tuple[bytes, ChunkMeta, memoryview]]:
    return named_items(names, FP, CHUNK)


keys = named_keys


async def held_tier(path: Path, names: List[str]) -> Tuple[LmdbTier, HeldListing]:
    """An LMDB tier holding ``names`` (written by an earlier open), its next listing held."""
    first = await LmdbTier.open(path)
    await first.put_many(items(names))
    await first.close()
    tier = await LmdbTier.open(path)
    hook = HeldListing()
    tier._io_hook = hook
    return tier, hook


@contextlib.asynccontextmanager
async def held_store(path: Path, names: List[str]) -> AsyncIterator[Tuple[DiskStore, LmdbTier, HeldListing]]:
    """A store on ``held_tier``, not waiting for its listing; closed with the tier at the end."""
    tier, hook = await held_tier(path, names)
    store = DiskStore(StoreConfig(disk_index_wait_s=0), fingerprint=FP, tier=tier)
    try:
        yield store, tier, hook
    finally:
        hook.release()
        await store.close()
        await tier.close()


@pytest.mark.asyncio
async def test_start_returns_while_the_listing_is_held_and_its_keys_join_after(tmp_path: Path):
    async with held_store(tmp_path / "kv", ["a", "b", "c"]) as (store, tier, hook):
        # Before the fix start awaited the listing: this wait ran out with the listing held.
        await asyncio.wait_for(store.start(), 10)
        await hook.wait_entered()
        assert store.listing and store.index.keys() == set()  # not listed yet: misses

        # A write meanwhile lands and is indexed; a removal meanwhile keeps its key out, although
        # the snapshot the listing took before it still holds the key.
        [(d_key, _, _)] = d_item = items(["d"])
        token = store.index.begin()
        assert store.index.add(d_key, token, await tier.put_many(d_item))
        store.index.end(token)
        assert await tier.delete_many(list(keys(["b"]))) == 1
        await asyncio.sleep(0)  # the removal report reaches the loop
        assert store.index.keys() == keys(["d"])

        hook.release()
        await asyncio.wait_for(store.wait_listed(), 10)
        assert not store.listing
        assert store.index.keys() == keys(["a", "c", "d"])
        assert await store.problems() == []


@pytest.mark.asyncio
async def test_settle_and_refresh_wait_for_the_listing(tmp_path: Path):
    async with held_store(tmp_path / "kv", ["a", "b"]) as (store, tier, hook):
        await store.start()
        await hook.wait_entered()
        settled = asyncio.ensure_future(store.settle())
        refreshed = asyncio.ensure_future(store.refresh())
        await asyncio.sleep(0.05)
        assert not settled.done() and not refreshed.done()
        hook.release()
        await asyncio.wait_for(settled, 10)
        assert store.index.keys() == keys(["a", "b"])
        assert await asyncio.wait_for(refreshed, 10) == (0, 0)  # the listing had them all


@pytest.mark.asyncio
async def test_close_during_the_listing_cancels_it_and_nothing_joins_later(tmp_path: Path):
    async with held_store(tmp_path / "kv", ["a", "b"]) as (store, tier, hook):
        await store.start()
        await hook.wait_entered()
        await asyncio.wait_for(store.close(), 10)  # with the listing still held in the tier
        assert not store.listing
        hook.release()
        await tier.flush()  # the held read has ended; its answer went nowhere
        await asyncio.sleep(0.01)
        assert store.index.keys() == set()


@pytest.mark.asyncio
async def test_an_owned_tier_opens_without_its_eviction_index_and_a_listing_merges_in_pages(tmp_path: Path,
                                                                                             monkeypatch):
    monkeypatch.setattr(store_module, "LISTING_PAGE_KEYS", 3)
    path = tmp_path / "kv"
    names = [str(i) for i in range(11)]
    first = await LmdbTier.open(path)
    await first.put_many(items(names))
    await first.close()
    config = StoreConfig(cache_dir=str(path), disk_index_wait_s=0, compression_enabled=False)
    store = await DiskStore.open(config, fingerprint=FP)
    try:
        turns = 0
        while store.listing:  # other work runs between the pages
            turns += 1
            await asyncio.sleep(0)
        assert turns >= 4  # 11 keys in pages of 3
        assert store.index.keys() == keys(names)
        await store.settle()  # the writer has built the eviction index by then
        stats = store.tier.statistics()
        assert stats.records == len(names) and await store.tier.check() == []
    finally:
        await store.close()


LAYOUT = ModelLayout(groups=(AttentionGroup(16),))
FINGERPRINT = b"listing-engine"


def engine_config(tmp_path: Path, **overrides) -> EngineConfig:
    values = dict(cache_dir=str(tmp_path / "cache"), host_capacity_bytes=1 << 20, lmdb_map_size_bytes=32 << 20,
                  pressure_poll_interval_s=3600.0, tier_timeout_s=5.0)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.mark.asyncio
async def test_the_engine_answers_misses_while_listing_then_the_disk_hit(tmp_path: Path):
    device = make_cpu_device(LAYOUT, num_blocks=64)
    async with OffloadEngine(LAYOUT, device, engine_config(tmp_path), fingerprint=FINGERPRINT) as producer:
        scenario = OffloadScenario(producer)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt, expect_stored={0: {0, 1}})
    tier = await LmdbTier.open(tmp_path / "cache")
    hook = HeldListing()
    tier._io_hook = hook
    engine = OffloadEngine(LAYOUT, device, engine_config(tmp_path, disk_index_wait_s=0), fingerprint=FINGERPRINT,
                           disk_tier=tier)
    try:
        await asyncio.wait_for(engine.start(), 10)
        await hook.wait_entered()
        consumer = OffloadScenario(engine)
        consumer.producer_bytes = scenario.producer_bytes
        await consumer.consume(prompt + [1], expect_hit=0)  # the disk's chunks: not listed yet
        hook.release()
        await engine.flush()  # waits for the listing
        await consumer.consume(prompt + [1], expect_hit=32, expect_loaded={0: {0, 1}})
        await engine.flush()
        engine.check()
        await engine.check_disk()
    finally:
        hook.release()
        await engine.close()
        await tier.close()
