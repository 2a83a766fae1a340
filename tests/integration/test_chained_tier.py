"""ChainedTier: LMDB first, the remote tier behind it, on a real Valkey node; its sequence order and
cancellation over two local tiers."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import pytest

from kvtier.engine import EngineConfig
from kvtier.engine.disk_index import DiskIndex
from kvtier.errors import TierFullError
from kvtier.tiers.base import KeySnapshot
from kvtier.tiers.chain import ChainedTier
from kvtier.tiers.files import FileTier
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.remote import RemoteTier
from kvtier.tools.testing.tier_seam import SeamTier

from kvtier.tools.testing.valkey import TEST_FINGERPRINT as FP
from kvtier.tools.testing.valkey import make_items, read_back, wait_for

_ns = itertools.count()


async def open_chain(tmp_path, url, *, write_policy="write_through", capacity_bytes=None, **remote_kwargs):
    ns = f"chain{os.getpid()}-{next(_ns)}"
    lmdb = await LmdbTier.open(str(tmp_path / f"lmdb-{ns}"), capacity_bytes=capacity_bytes)
    remote = await RemoteTier.open(url, namespace=ns, fingerprint=FP, **remote_kwargs)
    return ChainedTier([lmdb, remote], write_policy=write_policy), ns


@pytest.mark.asyncio
async def test_write_through_lands_in_both_and_reads_come_from_the_first(tmp_path, valkey_node):
    chain, _ = await open_chain(tmp_path, valkey_node.url)
    lmdb, remote = chain.tiers
    try:
        items = make_items(6, 64 << 10, seed=11)
        keys = [k for k, _, _ in items]
        seq = await chain.put_many(items)
        assert seq == chain.sequence == 1
        assert await lmdb.contains_many(keys) == [True] * 6
        await chain.flush()  # the write-behind to the remote
        assert await remote.contains_many(keys) == [True] * 6
        metas, bufs = await read_back(chain, items)
        assert all(m is not None for m in metas) and bytes(bufs[2]) == bytes(items[2][2])
        stats = chain.statistics()
        assert (stats.hits, stats.extra["hits.lmdb"], stats.extra["hits.remote"]) == (6, 6, 0)
        assert stats.extra["writebehind_chunks"] == 6 and stats.extra["remote.puts"] == 6
        assert "remote.breaker_open" in stats.extra and stats.extra["lmdb.records"] == 6
    finally:
        await chain.close()


@pytest.mark.asyncio
async def test_remote_only_chunks_are_seen_loaded_and_promoted(tmp_path, valkey_node):
    chain, ns = await open_chain(tmp_path, valkey_node.url)
    lmdb, remote = chain.tiers
    arrived = []
    chain.subscribe_arrivals(lambda keys, seq: arrived.append((sorted(keys), seq)))
    other_host = await RemoteTier.open(valkey_node.url, namespace=ns, fingerprint=FP)
    try:
        items = make_items(4, 32 << 10, seed=12)
        keys = [k for k, _, _ in items]
        await other_host.put_many(items)  # another host wrote them
        assert await chain.contains_many(keys) == [True] * 4
        assert sorted(await chain.list_keys()) == sorted(keys)
        metas, bufs = await read_back(chain, items)
        assert metas == [m for _, m, _ in items]
        assert all(bytes(b) == bytes(raw) for b, (_, _, raw) in zip(bufs, items))
        await chain.flush()
        assert await lmdb.contains_many(keys) == [True] * 4  # promoted remote -> LMDB
        # The landed promotion is an arrival (an index that dropped a key meanwhile takes it back),
        # at a sequence after every one the chain had given out before.
        assert arrived[-1][0] == sorted(keys) and arrived[-1][1] == chain.sequence
        assert chain.statistics().extra["promotions"] == 4
        assert chain.statistics().extra["hits.remote"] == 4
    finally:
        await other_host.close()
        await chain.close()


@pytest.mark.asyncio
async def test_removals_are_reported_only_when_no_tier_holds_the_key(tmp_path, valkey_node):
    chain, ns = await open_chain(tmp_path, valkey_node.url)
    lmdb, remote = chain.tiers
    removed = []
    chain.subscribe_removals(removed.extend)
    other_host = await RemoteTier.open(valkey_node.url, namespace=ns, fingerprint=FP)
    try:
        both = make_items(2, 1000, seed=13)
        remote_only = make_items(2, 1000, seed=14)
        await chain.put_many(both)
        await chain.flush()
        await other_host.put_many(remote_only)
        await chain.list_keys()  # the remote tier now knows every key
        # Gone from the server without a notification (another host's delete): the listing finds
        # it. For keys LMDB still holds the chain reports nothing; for remote-only keys it does.
        for key, _, _ in both + remote_only:
            valkey_node.command("DEL", remote.rkey(key))
        seq_before = chain.sequence
        assert await remote.reconcile() == 4
        assert await wait_for(lambda: len(removed) == 2)
        await chain.flush()
        assert sorted(r.key for r in removed) == sorted(k for k, _, _ in remote_only)
        assert all(r.reason == "external" and r.sequence > seq_before for r in removed)
        assert chain.statistics().extra["removals_held"] == 2
        assert chain.statistics().evictions == 2
        # A put after the removal wins: its sequence is later.
        seq = await chain.put_many(remote_only[:1])
        assert seq > max(r.sequence for r in removed)
    finally:
        await other_host.close()
        await chain.close()


@pytest.mark.asyncio
async def test_a_stalled_remote_is_never_worse_than_no_remote(tmp_path, valkey_factory):
    node = valkey_factory.node()
    chain, ns = await open_chain(tmp_path, node.url, timeout_s=0.3, breaker_failures=1, breaker_reset_s=30.0)
    other_host = await RemoteTier.open(node.url, namespace=ns, fingerprint=FP)
    try:
        remote_only = make_items(2, 1000, seed=15)
        await other_host.put_many(remote_only)
        with node.stalled():
            started = time.monotonic()
            items = make_items(3, 10_000, seed=16)
            await chain.put_many(items)  # LMDB is durable; the remote copy fails in the background
            metas, bufs = await read_back(chain, items)
            assert all(m is not None for m in metas) and bytes(bufs[0]) == bytes(items[0][2])
            assert (await read_back(chain, remote_only))[0] == [None, None]  # a miss, not an error
            assert await chain.contains_many([k for k, _, _ in remote_only]) == [False, False]
            await chain.flush()
            assert time.monotonic() - started < 3.0
            stats = chain.statistics()
            assert stats.extra["writebehind_failed"] == 3 and stats.extra["remote.breaker_open"] == 1
            assert stats.degraded and any("circuit" in p for p in await chain.check())
    finally:
        await other_host.close()
        await chain.close()


@pytest.mark.asyncio
async def test_write_back_on_evict_copies_down_only_near_capacity(tmp_path, valkey_node):
    chain, _ = await open_chain(tmp_path, valkey_node.url, write_policy="write_back_on_evict",
                                capacity_bytes=1 << 20)
    lmdb, remote = chain.tiers
    try:
        first = make_items(4, 100 << 10, seed=17)  # ~400 KiB of 1 MiB: no copy yet
        await chain.put_many(first)
        await chain.flush()
        assert await remote.contains_many([k for k, _, _ in first]) == [False] * 4
        more = make_items(6, 100 << 10, seed=18)  # past 90 %: the oldest are copied down
        for item in more:
            await chain.put_many([item])
        await chain.flush()
        copied = await remote.contains_many([k for k, _, _ in first + more])
        assert copied[:4] == [True] * 4  # the oldest first
        assert chain.statistics().extra["writebehind_chunks"] == sum(copied)
        metas, bufs = await read_back(remote, first)
        assert all(m is not None for m in metas) and bytes(bufs[3]) == bytes(first[3][2])
    finally:
        await chain.close()


@pytest.mark.asyncio
async def test_engine_config_builds_the_chain_and_starts_degraded_without_the_remote(tmp_path, valkey_node):
    from kvtier.engine import OffloadEngine
    from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT, OffloadScenario, make_cpu_device

    config = EngineConfig.from_dict({"cache_dir": str(tmp_path / "c"), "remote_url": valkey_node.url, "host_capacity_bytes": "1MiB",
                                     "remote_namespace": "cfg", "remote_timeout_s": "0.5",
                                     "remote_write_policy": "write_back_on_evict",
                                     "remote_promote_to_disk": "false"})
    async with OffloadEngine(DEFAULT_TEST_LAYOUT, make_cpu_device(DEFAULT_TEST_LAYOUT), config,
                             fingerprint=b"cfg-model") as engine:
        chain = engine.disk_tier
        assert isinstance(chain, ChainedTier) and chain.write_policy == "write_back_on_evict"
        assert chain.promote is False
        assert [t.name for t in chain.tiers] == ["lmdb", "remote"] and chain.tiers[1].namespace == "cfg"
        text = engine.metrics.exposition().decode()
        assert 'kvtier_tier_stat{stat="breaker_open",tier="remote"} 0.0' in text
        assert 'kvtier_tier_stat{stat="hits",tier="remote"}' in text and 'tier="lmdb"' in text
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bad = EngineConfig(cache_dir=str(tmp_path / "d"), remote_url=f"redis://127.0.0.1:{port}", host_capacity_bytes=1 << 20,
                       remote_timeout_s=0.3, remote_connect_timeout_s=0.3)
    async with OffloadEngine(DEFAULT_TEST_LAYOUT, make_cpu_device(DEFAULT_TEST_LAYOUT), bad,
                             fingerprint=b"cfg-model") as engine:
        # The remote is down: the engine serves from host and LMDB, the chain says it is degraded.
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        record = await scenario.produce(prompt)
        assert record.durable
        await scenario.consume(prompt + [1], expect_hit=32)
        assert engine.disk_tier.degraded
        assert engine.disk_tier.statistics().extra["remote.breaker_open"] == 1
    with pytest.raises(ValueError, match="remote_write_policy"):
        EngineConfig(remote_write_policy="sometimes")
    assert EngineConfig.from_env({"KVTIER_REMOTE_URL": ""}).remote_url is None


@pytest.mark.asyncio
async def test_primary_killed_during_write_behind_leaves_no_half_visible_request(tmp_path, valkey_factory):
    from kvtier.engine import OffloadEngine
    from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT, OffloadScenario, make_cpu_device
    from kvtier.tools.testing.valkey import restart_node

    cluster = valkey_factory.cluster(3)
    by_port = {n.port: i for i, n in enumerate(cluster.nodes)}

    def config(name: str) -> EngineConfig:
        return EngineConfig(cache_dir=str(tmp_path / name), host_capacity_bytes=1 << 20, remote_url=cluster.url,
                            remote_namespace="kill", remote_timeout_s=1.0, remote_breaker_reset_s=0.2)

    layout = DEFAULT_TEST_LAYOUT
    killed = []
    async with OffloadEngine(layout, make_cpu_device(layout), config("host-a"), fingerprint=b"kill-model") as a:
        chain = a.disk_tier
        remote = chain.tiers[1]

        stores = []

        def kill_on_the_second_store_pipeline(node, commands):
            if commands and commands[0][0] == "SET":
                stores.append(node.port)
                if len(stores) == 2:  # one pipeline per node: the second node dies mid-batch
                    killed.append(by_port[node.port])
                    os.kill(cluster.nodes[killed[0]].pid, signal.SIGKILL)

        remote.set_call_hook(kill_on_the_second_store_pipeline)
        scenario = OffloadScenario(a)
        prompt = scenario.tokens(33)
        record = await scenario.produce(prompt)
        assert record.durable  # LMDB has it: the remote's failure is not the store's
        await chain.flush()
        remote.set_call_hook(None)
        assert killed, "the hook never killed a primary"
        stats = chain.statistics()
        assert stats.extra["writebehind_failed"] == 8 and stats.extra["remote.rollbacks"] == 1
        producer_bytes = scenario.producer_bytes
    await asyncio.to_thread(restart_node, cluster, killed[0])

    # Host B never saw the prompt: the failed write-behind left nothing of it on the cluster, so
    # it misses cleanly (0 tokens) instead of hitting a part of the request.
    async with OffloadEngine(layout, make_cpu_device(layout), config("host-b"), fingerprint=b"kill-model") as b:
        assert b.lookup(prompt + [1]) == 0
        assert await b.disk_tier.tiers[1].list_keys() == []
    # Host A, restarted, still hits from its own LMDB, every byte checked.
    async with OffloadEngine(layout, make_cpu_device(layout), config("host-a"), fingerprint=b"kill-model") as a2:
        scenario = OffloadScenario(a2)
        scenario.producer_bytes = producer_bytes
        await scenario.consume(prompt + [1], expect_hit=32)


@pytest.mark.asyncio
async def test_server_evictions_leave_the_engine_index_within_the_bound(tmp_path, valkey_factory):
    from kvtier.engine import OffloadEngine
    from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT, OffloadScenario, make_cpu_device

    node = valkey_factory.node(maxmemory="4mb", maxmemory_policy="allkeys-lru")
    layout = DEFAULT_TEST_LAYOUT

    def config(name: str) -> EngineConfig:
        return EngineConfig(cache_dir=str(tmp_path / name), host_capacity_bytes=1 << 20, remote_url=node.url,
                            remote_namespace="evict")

    async with OffloadEngine(layout, make_cpu_device(layout), config("a"), fingerprint=b"evict-model") as a:
        scenario = OffloadScenario(a)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt)
    # Host B knows A's chunks only through the remote (its LMDB is empty).
    async with OffloadEngine(layout, make_cpu_device(layout), config("b"), fingerprint=b"evict-model") as b:
        remote = b.disk_tier.tiers[1]
        a_keys = set(b.disk_index.keys())
        assert len(a_keys) == 8 and b.lookup(prompt + [1]) == 32
        filler = await RemoteTier.open(node.url, namespace="evict", fingerprint=b"evict-model")
        try:
            for round_ in range(20):  # bounded: up to 20 x 1 MiB into a 4 MiB server
                try:
                    await filler.put_many(make_items(4, 256 << 10, seed=500 + round_, fingerprint=b"evict-model"))
                except TierFullError:
                    pass  # allkeys-lru too refuses a write it cannot make room for
                if not all(await remote.contains_many(list(a_keys))):
                    break
        finally:
            await filler.close()
        on_server = {k for k, p in zip(a_keys, await remote.contains_many(list(a_keys))) if p}
        assert on_server != a_keys, "nothing of A's was evicted"
        # Within the bound (notifications: milliseconds; 2 s allowed), B's index holds exactly the
        # chunks the server still has, and a lookup admits no hit whose chunks are gone.
        assert await wait_for(lambda: set(b.disk_index.keys()) & a_keys == on_server, timeout_s=2.0)
        hit = b.lookup(prompt + [1])
        if hit:  # what is left is loadable (the chunks the hit needs were not evicted)
            result = await b.load(prompt + [1], hit, OffloadScenario(b).allocate(34))
            assert result.ok


@pytest.mark.asyncio
async def test_promotion_off_keeps_remote_hits_out_of_lmdb(tmp_path, valkey_node):
    ns = f"chain{os.getpid()}-nopromote"
    lmdb = await LmdbTier.open(str(tmp_path / "lmdb"))
    remote = await RemoteTier.open(valkey_node.url, namespace=ns, fingerprint=FP)
    chain = ChainedTier([lmdb, remote], promote=False)
    try:
        items = make_items(3, 4096, seed=40)
        await remote.put_many(items)
        metas, bufs = await read_back(chain, items)
        assert all(m is not None for m in metas) and bytes(bufs[1]) == bytes(items[1][2])
        await chain.flush()
        assert await lmdb.contains_many([k for k, _, _ in items]) == [False] * 3
        assert chain.statistics().extra["promotions"] == 0
    finally:
        await chain.close()


# -- ordering and cancellation, over two local tiers (no server needed) -------------------------

ONE_RECORD = 100 << 10  # an LMDB capacity that holds one 64 KiB record, not two


async def local_chain(tmp_path, **kwargs):
    """A chain over a one-record LMDB behind a seam and a file tier behind a seam:
    (chain, lmdb, lmdb seam, file seam, removals the chain reported)."""
    lmdb = await LmdbTier.open(str(tmp_path / "lmdb"), capacity_bytes=ONE_RECORD)
    first = SeamTier(lmdb)
    lower = SeamTier(await FileTier.open(tmp_path / "files"))
    chain = ChainedTier([first, lower], **kwargs)
    removals: list = []
    chain.subscribe_removals(removals.extend)
    return chain, lmdb, first, lower, removals


@pytest.mark.asyncio
async def test_a_first_tier_eviction_before_the_put_returns_wins_over_the_put(tmp_path):
    # The put lands in LMDB, and LMDB evicts its key (another writer's record needs the room)
    # before the chain's call returns. The removal is of the record this put wrote, so by the
    # contract (readable iff put sequence > removal sequence) the put's sequence must be the
    # smaller: an engine ordering its index by them would otherwise keep a key no tier holds.
    chain, lmdb, first, _, removals = await local_chain(tmp_path, write_policy="write_back_on_evict")
    try:
        mine, other = make_items(2, 64 << 10, seed=31)
        gate = first.hold_next("put_many", after=True)  # landed in LMDB; the answer waits
        put = asyncio.ensure_future(chain.put_many([mine]))
        await gate.entered.wait()
        await lmdb.put_many([other])  # evicts mine
        assert await wait_for(lambda: removals)  # reported while the chain's put is in flight
        gate.release()
        sequence = await put
        assert [(r.key, r.reason) for r in removals] == [(mine[0], "evicted")]
        assert await chain.contains_many([mine[0], other[0]]) == [False, True]
        assert removals[0].sequence > sequence  # so the key reads as gone, as it is
        index = DiskIndex()  # the engine's view, ordered by these sequences
        token = index.begin()
        index.remove(mine[0], removals[0].sequence)
        assert index.add(mine[0], token, sequence) is False
    finally:
        await chain.close()


@pytest.mark.asyncio
async def test_a_snapshot_stays_below_a_put_in_flight(tmp_path):
    chain, _, first, _, _ = await local_chain(tmp_path)
    try:
        (item,) = make_items(1, 1 << 10, seed=32)
        gate = first.hold_next("put_many")  # the put has its sequence, nothing landed
        put = asyncio.ensure_future(chain.put_many([item]))
        await gate.entered.wait()
        snapshot = await chain.snapshot_keys()
        gate.release()
        sequence = await put
        assert (snapshot.keys, snapshot.sequence) == (frozenset(), sequence - 1)
        assert (await chain.snapshot_keys()) == KeySnapshot(frozenset([item[0]]), sequence)
    finally:
        await chain.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("wait", ["flush", "close"])
async def test_cancelling_flush_or_close_never_loses_a_removal_report(tmp_path, wait):
    # A first-tier eviction is reported only after the lower tier said it does not hold the key;
    # that check is the chain's own work: a caller cancelling its wait must not cancel it.
    chain, lmdb, _, lower, removals = await local_chain(tmp_path)
    try:
        evicted, other = make_items(2, 64 << 10, seed=33)
        gate = lower.hold_next("contains_many")
        await lmdb.put_many([evicted])
        await lmdb.put_many([other])  # evicts the first
        await gate.entered.wait()  # the chain is asking the file tier about it
        waiting = asyncio.ensure_future(getattr(chain, wait)())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.release()
        await getattr(chain, wait)()  # waits for the same work, uncancelled
        assert [(r.key, r.reason) for r in removals] == [(evicted[0], "evicted")]
    finally:
        await chain.close()


@pytest.mark.asyncio
async def test_chunks_another_host_writes_reach_this_index_without_a_listing(tmp_path, valkey_cluster):
    from kvtier.engine import OffloadEngine
    from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT, OffloadScenario, make_cpu_device

    layout = DEFAULT_TEST_LAYOUT
    namespace = f"arrive{os.getpid()}"

    def config(name: str, **extra) -> EngineConfig:
        return EngineConfig(cache_dir=str(tmp_path / name), host_capacity_bytes=1 << 20, remote_url=valkey_cluster.url,
                            remote_namespace=namespace, remote_listing_interval_s=3600.0, **extra)

    device = make_cpu_device(layout)
    async with OffloadEngine(layout, make_cpu_device(layout), config("b"), fingerprint=b"arrive-model") as b, \
            OffloadEngine(layout, make_cpu_device(layout), config("c", remote_watch_new_keys=False),
                          fingerprint=b"arrive-model") as c:
        assert not b.disk_index.keys() and not c.disk_index.keys()
        async with OffloadEngine(layout, device, config("a"), fingerprint=b"arrive-model") as a:
            producer = OffloadScenario(a)
            prompt = producer.tokens(33)
            await producer.produce(prompt)
            await a.disk_tier.flush()
            written = set(a.disk_index.keys())
            assert len(written) == 8
            # B started before A wrote and never lists again: the new-key notices index A's
            # chunks (within the bound), and B loads them bitwise from the cluster.
            assert await wait_for(lambda: set(b.disk_index.keys()) == written, timeout_s=2.0)
            assert b.disk_tier.tiers[1].statistics().extra["arrivals_notified"] >= 8
            consumer = OffloadScenario(b)
            consumer.producer_bytes = producer.producer_bytes
            await consumer.consume(prompt + [1], expect_hit=32)
            # C does not watch: the chunks reach it only through a listing.
            assert c.lookup(prompt + [1]) == 0 and not c.disk_index.keys()
            assert await c.refresh_disk_index() == (8, 0)
            assert c.lookup(prompt + [1]) == 32


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_through", "write_back_on_evict"])
async def test_a_batch_the_lmdb_cannot_take_still_reaches_the_remote(tmp_path, valkey_factory, write_policy):
    from kvtier.errors import TierIOError
    from kvtier.tools.testing.faults import inject_io_faults, remove_io_faults

    valkey_node = valkey_factory.node()
    chain, ns = await open_chain(tmp_path, valkey_node.url, write_policy=write_policy, timeout_s=0.5)
    lmdb, remote = chain.tiers
    other_host = await RemoteTier.open(valkey_node.url, namespace=ns, fingerprint=FP)
    try:
        items = make_items(5, 64 << 10, seed=41)
        keys = [k for k, _, _ in items]
        plan = inject_io_faults(lmdb, fail_from=1)  # every LMDB read, put and commit fails (EIO)
        # The LMDB put fails; the bytes are still the caller's, so the remote takes the batch and
        # the put succeeds: the chunks are readable from the chain, not lost to the fleet.
        seq = await chain.put_many(items)
        assert seq == chain.sequence
        assert plan.faults > 0
        assert await remote.contains_many(keys) == [True] * 5
        assert chain.statistics().extra["kept_below"] == 5
        # Readable, bitwise, by another host (straight from the server) and through the chain.
        metas, bufs = await read_back(other_host, items)
        assert metas == [m for _, m, _ in items]
        assert [bytes(b) for b in bufs] == [bytes(raw) for _, _, raw in items]
        remove_io_faults(lmdb)
        assert await lmdb.contains_many(keys) == [False] * 5
        metas, bufs = await read_back(chain, items)
        assert [bytes(b) for b in bufs] == [bytes(raw) for _, _, raw in items]

        # No tier takes it (the remote's server gone too): the LMDB's error, raised as it is.
        await other_host.close()
        valkey_node.stop()
        inject_io_faults(lmdb, fail_from=1)
        with pytest.raises(TierIOError):
            await chain.put_many(make_items(3, 64 << 10, seed=42))
    finally:
        remove_io_faults(lmdb)
        await chain.close()


@pytest.mark.asyncio
async def test_a_chunk_served_from_lmdb_is_a_use_the_shared_remote_hears_of(tmp_path, valkey_node):
    chain, _ = await open_chain(tmp_path, valkey_node.url)
    lmdb, remote = chain.tiers
    try:
        items = make_items(4, 16 << 10, seed=51)
        await chain.put_many(items)
        await chain.flush()
        await asyncio.sleep(2.1)  # the server's LRU clock counts whole seconds
        idle = [int(valkey_node.command("OBJECT", "IDLETIME", remote.rkey(k))) for k, _, _ in items]
        assert min(idle) >= 2
        metas, bufs = await read_back(chain, items[:2])  # served by LMDB, not the remote
        assert chain.statistics().extra["hits.lmdb"] == 2 and chain.statistics().extra["hits.remote"] == 0
        await chain.flush()  # the touch runs in the background
        idle = [int(valkey_node.command("OBJECT", "IDLETIME", remote.rkey(k))) for k, _, _ in items]
        assert idle[:2] == [0, 0] and min(idle[2:]) >= 2, idle
        assert remote.statistics().extra["touches"] == 2
    finally:
        await chain.close()
