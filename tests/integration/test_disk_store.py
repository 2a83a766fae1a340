"""DiskStore: the store layer the engine and the vLLM tier stand on, on real LMDB and real files."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import List, Tuple

import pytest

from kvtier.engine.config import StoreConfig
from kvtier.engine.store import DiskStore
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier

from named_records import named_items, named_keys

FP = b"store-test"
CHUNK = 4096


def items(names: List[str]) -> List[Tuple[bytes, ChunkMeta, memoryview]]:
    return named_items(names, FP, CHUNK)


keys = named_keys


@pytest.mark.asyncio
async def test_open_lists_what_the_directory_holds_and_close_releases_it(tmp_path: Path):
    config = StoreConfig(cache_dir=str(tmp_path / "kv"), compression_enabled=False)
    store = await DiskStore.open(config, fingerprint=FP)
    try:
        assert store.index.keys() == set() and store.owns_tier and store.local_tier is store.tier
        sequence = await store.tier.put_many(items(["a", "b", "c"]))
        assert sequence > 0
    finally:
        await store.close()
    assert store.tier.closed
    again = await DiskStore.open(config, fingerprint=FP)
    try:
        assert again.index.keys() == keys(["a", "b", "c"])
        assert await again.problems() == []
        assert again.quarantined_cache_dir is None
    finally:
        await again.close()
    await again.close()  # twice is fine


@pytest.mark.asyncio
async def test_capacity_evictions_leave_the_index_through_the_removal_subscription(tmp_path: Path):
    left: List[bytes] = []
    evicted: List[int] = []
    config = StoreConfig(cache_dir=str(tmp_path / "kv"), disk_capacity_bytes=3 * CHUNK + 1024,
                         compression_enabled=False, lmdb_segment_threshold_bytes=None)
    store = await DiskStore.open(config, fingerprint=FP, on_removed=left.append, on_evicted=evicted.append)
    try:
        for name in ["a", "b", "c", "d", "e"]:
            token = store.index.begin()
            batch = items([name])
            sequence = await store.tier.put_many(batch)
            assert store.index.add(batch[0][0], token, sequence)
            store.index.end(token)
        await store.settle()
        on_disk = set(await store.tier.list_keys())
        assert store.index.keys() == on_disk and len(on_disk) < 5
        gone = keys(["a", "b", "c", "d", "e"]) - on_disk
        assert set(left) == gone and len(left) == len(gone)  # each key left once, through the hook
        assert sum(evicted) == len(gone)
        assert await store.problems() == []
    finally:
        await store.close()


class _ListingWaits(LmdbTier):
    """A real LMDB tier whose listing, once taken, waits for ``gate`` before it answers: a removal
    can then reach the store while the listing is on its way."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.listed = asyncio.Event()
        self.gate = asyncio.Event()

    async def snapshot_keys(self):
        taken = await super().snapshot_keys()
        self.listed.set()
        await self.gate.wait()
        return taken


@pytest.mark.asyncio
async def test_a_removal_during_the_start_up_listing_keeps_its_key_out(tmp_path: Path):
    tier = _ListingWaits(tmp_path / "kv")
    try:
        await tier.put_many(items(["a", "b"]))
        store = DiskStore(StoreConfig(), fingerprint=FP, tier=tier)
        start = asyncio.ensure_future(store.start())
        await tier.listed.wait()  # the listing holds a and b ...
        assert await tier.delete_many([items(["a"])[0][0]]) == 1  # ... and a is deleted meanwhile
        for _ in range(3):
            await asyncio.sleep(0)  # the removal report reaches the loop before the listing does
        tier.gate.set()
        await start
        # Without the ordering the listing would put a back: a hit whose record is gone.
        assert store.index.keys() == keys(["b"])
        assert await store.problems() == []
        await store.close()
        assert not tier.closed  # a tier passed in is the caller's to close
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_refresh_sees_another_writer_and_an_empty_store_finds_nothing(tmp_path: Path):
    config = StoreConfig(cache_dir=str(tmp_path / "kv"))
    store = await DiskStore.open(config, fingerprint=FP)
    try:
        await store.tier.put_many(items(["x", "y"]))  # written around the index, as another process would
        assert store.index.keys() == set()
        assert await store.refresh() == (2, 0)
        assert store.index.keys() == keys(["x", "y"])
        await store.tier.delete_many([items(["x"])[0][0]])
        await store.settle()
        assert store.index.keys() == keys(["y"])  # the delete's removal report, not a refresh
        assert await store.refresh() == (0, 0)
    finally:
        await store.close()
    empty = await DiskStore.open(StoreConfig(), fingerprint=FP)
    assert empty.tier is None and await empty.refresh() == (0, 0) and await empty.problems() == []
    await empty.settle()
    await empty.close()


@pytest.mark.asyncio
async def test_a_damaged_directory_is_moved_aside_unless_read_only(tmp_path: Path):
    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    (cache / "data.mdb").write_bytes(b"not an LMDB file" * 512)
    store = await DiskStore.open(StoreConfig(cache_dir=str(cache)), fingerprint=FP)
    try:
        assert store.quarantined_cache_dir is not None and Path(store.quarantined_cache_dir).exists()
        assert store.index.keys() == set() and await store.problems() == []
    finally:
        await store.close()
    from kvtier.tiers.lmdb import CorruptCacheError

    (cache / "data.mdb").write_bytes(b"not an LMDB file" * 512)
    with pytest.raises(CorruptCacheError):
        await DiskStore.open(StoreConfig(cache_dir=str(cache), read_only=True), fingerprint=FP)
    assert (cache / "data.mdb").read_bytes().startswith(b"not an LMDB file")  # left alone


@pytest.mark.asyncio
async def test_an_arrival_outlives_the_late_report_of_its_older_records_removal(tmp_path: Path):
    from kvtier.tiers.base import Removal

    store = await DiskStore.open(StoreConfig(cache_dir=str(tmp_path / "kv"), compression_enabled=False),
                                 fingerprint=FP)
    try:
        [a, b] = keys(["a", "b"])
        store._arrived([a], 3)  # another writer's record of "a", announced at the tier's sequence 3
        assert a in store.index
        # The server evicted that record (the tier's sequence 5 for the removal), and another
        # writer wrote "a" again (sequence 6): the new arrival reaches the store before the
        # removal does (a chain asks its other tiers before it reports one).
        store._arrived([a, b], 6)
        store._removed([Removal(a, 5, "evicted")])
        assert a in store.index and b in store.index  # the removal was of the older record
        store._removed([Removal(a, 7, "evicted")])
        assert a not in store.index and b in store.index
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_problems_names_a_ghost_and_nothing_right_after_a_load_found_a_record_corrupt(tmp_path: Path):
    from kvtier.tools.testing.faults import corrupt_stored_record

    config = StoreConfig(cache_dir=str(tmp_path / "kv"), compression_enabled=False)
    store = await DiskStore.open(config, fingerprint=FP)
    try:
        batch = items(["a", "b"])
        token = store.index.begin()
        sequence = await store.tier.put_many(batch)
        for key, _, _ in batch:
            assert store.index.add(key, token, sequence)
        ghost = items(["never-stored"])[0][0]
        assert store.index.add(ghost, token, sequence)  # indexed, never written: a lookup would lie
        store.index.end(token)
        assert await store.problems() == [f"1 indexed keys are not on the disk tier (first {ghost.hex()[:12]})"]
        store.index.discard(ghost)
        assert await store.problems() == []

        # A load finds a's record corrupt: the quarantine runs on the writer thread and its removal
        # report comes back through the loop. Asked at once, the check settles first and sees
        # neither a ghost nor a stray key.
        a = batch[0][0]
        await asyncio.get_running_loop().run_in_executor(None, corrupt_stored_record, store.tier, a)
        out = bytearray(CHUNK)
        assert await store.tier.get_many_into([(a, memoryview(out))]) == [None]
        assert await store.problems() == []
        assert store.index.keys() == keys(["b"])
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_problems_waits_for_a_remote_eviction_notice_still_on_its_way(tmp_path: Path, valkey_factory):
    from kvtier.tiers.remote import RemoteTier
    from kvtier.tools.testing.valkey import wait_for

    node = valkey_factory.node()
    namespace = f"store{tmp_path.name[-12:]}".replace("_", "-")
    config = StoreConfig(cache_dir=str(tmp_path / "kv"), compression_enabled=False, remote_url=node.url,
                         remote_namespace=namespace)
    store = await DiskStore.open(config, fingerprint=FP)
    other_host = await RemoteTier.open(node.url, namespace=namespace, fingerprint=FP, listing_interval_s=None)
    try:
        batch = items(["a", "b", "c"])
        await other_host.put_many(batch)  # another host's records: indexed here by their notices
        assert await wait_for(lambda: store.index.keys() == keys(["a", "b", "c"]), timeout_s=5.0)
        # The server drops "b" as the check lists the tier: its notice is on its way, the listing
        # does not find it, and the index still holds it when the listing ends.
        remote = store.tier.tiers[1]
        dropped = []

        def drop_while_listing(_node, commands) -> None:
            if commands and commands[0][0] == "SCAN" and not dropped:
                dropped.append(node.command("DEL", other_host.rkey(batch[1][0])))

        remote.set_call_hook(drop_while_listing)
        assert await store.problems() == []
        remote.set_call_hook(None)
        assert dropped == [1] and store.index.keys() == keys(["a", "c"])
    finally:
        await other_host.close()
        await store.close()
