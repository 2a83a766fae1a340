"""RemoteTier against real Valkey servers on 127.0.0.1: one node and a 3-primary cluster.

Every test isolates itself with its own namespace on the shared servers, or starts private servers
(``valkey_factory``) when it breaks them. Every wait is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from typing import List, Tuple

import pytest

from kvtier.errors import ClosedError, TierFullError, TierIOError
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.record_format import CodecConfig
from kvtier.tiers.remote import RemoteTier, parse_remote_url
from kvtier.tiers.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvtier.tools.testing.valkey import TEST_FINGERPRINT, make_items, read_back, wait_for

FP = TEST_FINGERPRINT
META = ChunkMeta(FP, 0, 3, "bfloat16", (2, 16, 64))
_ns = itertools.count()


def namespace() -> str:
    return f"t{os.getpid()}-{next(_ns)}"


async def overfill(tier: RemoteTier, items: List[Tuple[bytes, ChunkMeta, memoryview]], *, batch: int) -> List[bytes]:
    """Put ``items`` ``batch`` at a time into a server too small for them; returns the keys of the
    batches it accepted (allkeys-lru too refuses a write it cannot make room for: counted, not
    stored)."""
    keys: List[bytes] = []
    for i in range(0, len(items), batch):
        try:
            await tier.put_many(items[i:i + batch])
            keys += [k for k, _, _ in items[i:i + batch]]
        except TierFullError:
            pass
    return keys


@pytest.fixture(params=["node", "cluster"])
def url(request, valkey_node, valkey_cluster) -> str:
    return valkey_node.url if request.param == "node" else valkey_cluster.url


# ------------------------------------------------------------------------------ round trips


@pytest.mark.asyncio
async def test_put_get_contains_list_delete_round_trip(url):
    tier = await RemoteTier.open(url, namespace=namespace(), fingerprint=FP, pipeline_max_bytes=300_000)
    removed = []
    tier.subscribe_removals(removed.extend)
    try:
        items = make_items(24, 100_000)
        seq = await tier.put_many(items)
        assert seq == tier.sequence >= 1
        metas, bufs = await read_back(tier, items)
        assert metas == [meta for _, meta, _ in items]
        assert all(bytes(b) == bytes(raw) for b, (_, _, raw) in zip(bufs, items))
        keys = [k for k, _, _ in items]
        assert await tier.contains_many(keys + [b"absent"]) == [True] * 24 + [False]
        assert sorted(await tier.list_keys()) == sorted(keys)
        assert await tier.delete_many(keys[:5] + [b"absent"]) == 5
        await wait_for(lambda: len(removed) == 5)
        assert sorted(r.key for r in removed) == sorted(keys[:5])
        assert {r.reason for r in removed} == {"deleted"} and all(r.sequence > seq for r in removed)
        metas, _ = await read_back(tier, items)
        assert [m is None for m in metas] == [True] * 5 + [False] * 19
        stats = tier.statistics()
        assert (stats.puts, stats.put_batches, stats.hits, stats.misses, stats.deletes) == (24, 1, 43, 5, 5)
        assert stats.records == 19 and stats.errors == 0 and not stats.degraded
        assert stats.extra["nodes"] == (3 if url.startswith("redis+cluster") else 1)
        assert stats.extra["breaker_open"] == 0 and stats.extra["notifications_on"] == stats.extra["nodes"]
        assert await tier.check() == []
    finally:
        await tier.close()
    with pytest.raises(ClosedError):
        await tier.contains_many([b"k"])


@pytest.mark.asyncio
async def test_compressed_records_and_other_buffer_sizes(valkey_node):
    tier = await RemoteTier.open(valkey_node.url, namespace=namespace(), fingerprint=FP,
                                 codec=CodecConfig(compress=True))
    try:
        raw = bytes(range(256)) * 4096  # compresses
        key = b"k" * 32
        await tier.put_many([(key, META, memoryview(raw))])
        buf = bytearray(len(raw))
        assert await tier.get_many_into([(key, memoryview(buf))]) == [META]
        assert bytes(buf) == raw
        # A buffer of another size is a miss that leaves the record in place.
        assert await tier.get_many_into([(key, memoryview(bytearray(10)))]) == [None]
        assert await tier.contains_many([key]) == [True]
        assert tier.statistics().mismatched == 1
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_bounded_concurrency_under_many_concurrent_callers(valkey_cluster):
    # redis-py's own cluster client raised past max_connections (500 concurrent GETs: 200 errors);
    # kvtier's per-node semaphore queues instead: 400 concurrent calls over 2 connections per node.
    tier = await RemoteTier.open(valkey_cluster.url, namespace=namespace(), fingerprint=FP, concurrency=2)
    try:
        items = make_items(100, 4096, seed=1)
        await tier.put_many(items)
        calls = [read_back(tier, [items[i % 100]]) for i in range(300)]
        calls += [tier.contains_many([items[i][0]]) for i in range(100)]
        outcomes = await asyncio.gather(*calls)
        for i, (metas, bufs) in enumerate(outcomes[:300]):
            assert metas[0] == items[i % 100][1] and bytes(bufs[0]) == bytes(items[i % 100][2])
        assert all(o == [True] for o in outcomes[300:])
        assert tier.statistics().errors == 0
    finally:
        await tier.close()


def test_urls_and_arguments_are_checked():
    assert parse_remote_url("redis://127.0.0.1:6379").seeds == (("127.0.0.1", 6379),)
    address = parse_remote_url("redis+cluster://a:1,b:2")
    assert address.cluster and address.seeds == (("a", 1), ("b", 2))
    for bad, message in [
        ("http://a:1", "must start with"),
        ("redis://a", "host:port"),
        ("redis://a:99999", "1..65535"),
        ("redis://a:1,b:2", "one host:port"),
        ("redis://user:pw@a:1", "port must be a number|credentials"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_remote_url(bad)


@pytest.mark.asyncio
async def test_bad_keys_and_namespaces_are_value_errors(valkey_node):
    with pytest.raises(ValueError, match="namespace"):
        await RemoteTier.open(valkey_node.url, namespace="a:b")
    with pytest.raises(ValueError, match="timeout_s"):
        await RemoteTier.open(valkey_node.url, timeout_s=0)
    tier = await RemoteTier.open(valkey_node.url, namespace=namespace())
    try:
        with pytest.raises(ValueError, match="length must be 1..511, got 0"):
            await tier.put_many([(b"", META, memoryview(b"x"))])
        with pytest.raises(ValueError, match="got 512"):
            await tier.contains_many([b"x" * 512])
        with pytest.raises(TypeError, match="bytes"):
            await tier.get_many_into([("k", memoryview(bytearray(1)))])
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_unreachable_server_is_a_tier_io_error_at_open():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TierIOError):
        await RemoteTier.open(f"redis+cluster://127.0.0.1:{port}", timeout_s=0.5, connect_timeout_s=0.5)
    assert time.monotonic() - started < 3.0


# ------------------------------------------------------------------- foreign and corrupt values


@pytest.mark.asyncio
async def test_corrupted_value_is_a_miss_deleted_counted_and_reported(url):
    tier = await RemoteTier.open(url, namespace=namespace(), fingerprint=FP)
    removed = []
    tier.subscribe_removals(removed.extend)
    try:
        items = make_items(3, 50_000, seed=2)
        await tier.put_many(items)
        rkey = tier.rkey(items[1][0])
        raw = _raw_client(url, rkey)
        value = bytearray(raw.get(rkey))
        value[-1] ^= 0xFF  # one flipped payload byte
        raw.set(rkey, bytes(value))
        metas, bufs = await read_back(tier, items)
        assert [m is not None for m in metas] == [True, False, True]
        assert raw.exists(rkey) == 0  # deleted: no host reads it again
        stats = tier.statistics()
        assert (stats.corrupt, stats.quarantined) == (1, 1)
        await wait_for(lambda: removed)
        assert [(r.key, r.reason) for r in removed] == [(items[1][0], "quarantined")]
        raw.close()
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_values_of_another_namespace_or_fingerprint_are_never_hits(valkey_cluster):
    url = valkey_cluster.url
    ns_a, ns_b = namespace(), namespace()
    a = await RemoteTier.open(url, namespace=ns_a, fingerprint=FP)
    b = await RemoteTier.open(url, namespace=ns_b, fingerprint=FP)
    other_model = await RemoteTier.open(url, namespace=ns_a, fingerprint=b"another-model")
    try:
        items = make_items(4, 10_000, seed=3)
        await a.put_many(items)
        keys = [k for k, _, _ in items]
        # Same chunk keys, other namespace / other model: nothing is seen.
        assert (await read_back(b, items))[0] == [None] * 4
        assert (await read_back(other_model, items))[0] == [None] * 4
        assert await b.contains_many(keys) == [False] * 4 and await b.list_keys() == []
        # A value copied under the other namespace's name fails its checksum (bound to the full
        # name): a miss, deleted, counted.
        raw = _raw_client(url, a.rkey(keys[0]))
        raw_b = _raw_client(url, b.rkey(keys[0]))
        raw_b.set(b.rkey(keys[0]), raw.get(a.rkey(keys[0])))
        assert (await read_back(b, items[:1]))[0] == [None]
        assert b.statistics().corrupt == 1 and raw_b.exists(b.rkey(keys[0])) == 0
        # A record of another model written under this tier's own name (re-encoded with a valid
        # checksum for that name) is a miss too: the fingerprint in its header differs.
        from kvtier.tiers.record_format import encode_record

        foreign = encode_record(b.rkey(keys[1]), ChunkMeta(b"another-model", 0, 1, "bfloat16", (5000,)),
                                bytes(items[1][2]))
        _raw_client(url, b.rkey(keys[1])).set(b.rkey(keys[1]), foreign)
        assert (await read_back(b, items[1:2]))[0] == [None]
        assert b.statistics().mismatched == 1
        assert (await read_back(a, items))[0] == [m for _, m, _ in items]  # a's own are intact
        raw.close()
        raw_b.close()
    finally:
        for t in (a, b, other_model):
            await t.close()


def _raw_client(url: str, rkey: bytes):
    """A plain client connected to the node that owns ``rkey`` (tests plant values with it)."""
    import redis
    from redis.crc import key_slot

    address = parse_remote_url(url)
    host, port = address.seeds[0]
    if address.cluster:
        probe = redis.Redis(host=host, port=port)
        slot = key_slot(rkey)
        for start, end, primary, *_ in probe.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                host, port = primary[0].decode(), int(primary[1])
        probe.close()
    return redis.Redis(host=host, port=port, socket_timeout=5)


# -------------------------------------------------------------------------------- server faults


@pytest.mark.asyncio
async def test_noeviction_memory_full_fails_stores_cleanly_and_counts_them(valkey_factory):
    node = valkey_factory.node(maxmemory="4mb", maxmemory_policy="noeviction")
    tier = await RemoteTier.open(node.url, namespace=namespace(), fingerprint=FP)
    try:
        stored: List[Tuple[bytes, ChunkMeta, memoryview]] = []
        full = 0
        for round_ in range(40):  # bounded: 40 x 256 KiB = 10 MiB offered to a 4 MiB server
            batch = make_items(1, 256 << 10, seed=100 + round_)
            try:
                await tier.put_many(batch)
                stored.extend(batch)
            except TierFullError as exc:
                assert "out of memory" in str(exc)
                full += 1
        assert full > 0 and stored
        stats = tier.statistics()
        assert stats.extra["full"] == full and stats.puts == len(stored) and stats.errors == full
        # What was stored is intact; what failed is not there (nothing half-written).
        metas, bufs = await read_back(tier, stored)
        assert all(m is not None for m in metas)
        assert all(bytes(b) == bytes(raw) for b, (_, _, raw) in zip(bufs, stored))
        assert len(await tier.list_keys()) == len(stored)
        assert not tier.degraded  # a full server is healthy: the breaker stays closed
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_a_record_above_the_servers_value_limit_is_refused_before_sending(valkey_factory):
    # Measured: a value above proto-max-bulk-len gets the connection reset, not an error.
    node = valkey_factory.node(proto_max_bulk_len="1mb")
    tier = await RemoteTier.open(node.url, namespace=namespace(), fingerprint=FP)
    try:
        small, big = make_items(1, 1000, seed=30), make_items(1, 2 << 20, seed=31)
        with pytest.raises(TierFullError, match="exceeds the server's proto-max-bulk-len of 1048576 bytes"):
            await tier.put_many(small + big)
        assert await tier.contains_many([small[0][0], big[0][0]]) == [False, False]
        await tier.put_many(small)  # the connection and the breaker are fine
        assert not tier.degraded and tier.statistics().extra["breaker_opens"] == 0
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_server_evictions_reach_subscribers_within_the_bound(valkey_factory):
    # Notifications off on the server: the tier turns them on (adding E and e to the flags).
    node = valkey_factory.node(maxmemory="6mb", maxmemory_policy="allkeys-lru", notify_keyspace_events="")
    tier = await RemoteTier.open(node.url, namespace=namespace(), fingerprint=FP)
    flags = node.command("CONFIG", "GET", "notify-keyspace-events")[b"notify-keyspace-events"]
    assert b"E" in flags and b"e" in flags
    removed = []
    tier.subscribe_removals(removed.extend)
    try:
        items = make_items(60, 256 << 10, seed=5)  # 15 MiB into 6 MiB: most are evicted
        keys = await overfill(tier, items, batch=4)
        present = await tier.contains_many(keys)
        gone = {k for k, p in zip(keys, present) if not p}
        assert len(gone) >= 20
        # Notifications arrive within the bound (2 s here; the listing is the backstop).
        assert await wait_for(lambda: {r.key for r in removed} == gone, timeout_s=2.0), (len(removed), len(gone))
        assert all(r.reason == "evicted" for r in removed)
        assert len(removed) == len(gone)  # each reported once
        assert tier.statistics().evictions == len(gone)
        stored = [it for it in items if it[0] in set(keys)]
        metas, _ = await read_back(tier, stored)
        missed = {k for (k, _, _), m in zip(stored, metas) if m is None}
        # Every miss is a reported eviction: those above, and any the server made while it sent
        # the read's replies (its output buffers count against maxmemory).
        assert gone <= missed
        assert await wait_for(lambda: missed <= {r.key for r in removed}, timeout_s=2.0), missed - {r.key for r in removed}
        assert all(r.reason == "evicted" for r in removed) and len(removed) == len({r.key for r in removed})
        # A removal no notification tells of (another host's delete): the listing reports it.
        survivor = next(k for (k, _, _), m in zip(stored, metas) if m is not None)
        node.command("DEL", tier.rkey(survivor))
        assert await tier.reconcile() == 1
        await wait_for(lambda: removed[-1].key == survivor)
        assert (removed[-1].key, removed[-1].reason) == (survivor, "external")
        assert await tier.reconcile() == 0  # reported once
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_cluster_evictions_are_heard_from_every_primary(valkey_factory):
    from redis.crc import key_slot

    # Notifications are node-local: one subscription per primary must hear each one's evictions.
    cluster = valkey_factory.cluster(3, maxmemory="4mb", maxmemory_policy="allkeys-lru")
    tier = await RemoteTier.open(cluster.url, namespace=namespace(), fingerprint=FP)
    removed = []
    tier.subscribe_removals(removed.extend)
    try:
        items = make_items(96, 128 << 10, seed=21)  # 12 MiB into 3 x 4 MiB
        keys = await overfill(tier, items, batch=3)
        gone = {k for k, p in zip(keys, await tier.contains_many(keys)) if not p}
        nodes = {cluster.node_for_slot(key_slot(tier.rkey(k))).port for k in gone}
        assert len(nodes) >= 2, "evictions on one primary only: the test proves nothing"
        heard = await wait_for(lambda: {r.key for r in removed} == gone, timeout_s=5.0)
        reported = {r.key for r in removed}
        assert heard, (len(reported - gone), len(gone - reported), len(gone), dict(tier.statistics().extra))
        assert len(removed) == len(gone) and tier.statistics().extra["notifications_on"] == 3
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_stalled_node_times_out_within_the_bound_opens_the_breaker_and_heals(valkey_factory):
    node = valkey_factory.node()
    timeout_s = 0.3
    tier = await RemoteTier.open(node.url, namespace=namespace(), fingerprint=FP, timeout_s=timeout_s,
                                 breaker_failures=2, breaker_reset_s=0.5)
    try:
        items = make_items(4, 100_000, seed=6)
        await tier.put_many(items)
        with node.stalled():
            started = time.monotonic()
            metas, _ = await read_back(tier, items)
            elapsed = time.monotonic() - started
            assert metas == [None] * 4  # a read of a stalled node is a miss, never an error
            assert elapsed < 2 * timeout_s + 1.0, elapsed  # the client default took 11-19 s
            stats = tier.statistics()
            assert stats.extra["timeouts"] >= 1 and stats.extra["breaker_open"] == 1 and stats.degraded
            # Open breaker: refused at once, no network wait.
            started = time.monotonic()
            assert (await read_back(tier, items))[0] == [None] * 4
            with pytest.raises(TierIOError, match="circuit open"):
                await tier.put_many(make_items(1, 10, seed=7))
            assert time.monotonic() - started < 0.25  # no network wait (a timeout would be 0.3 s each)
            assert tier.statistics().extra["breaker_rejected"] >= 5
            assert any("circuit" in p for p in await tier.check())
        # Healed: after reset_s one probe closes the breaker and reads hit again.
        healed = False
        for _ in range(40):  # bounded: up to ~2 s
            metas, bufs = await read_back(tier, items)
            if all(m is not None for m in metas):
                healed = True
                break
            await asyncio.sleep(0.05)
        assert healed and bytes(bufs[0]) == bytes(items[0][2])
        assert tier.degraded  # the refused put: degraded until a put lands
        await tier.put_many(make_items(1, 10, seed=9))
        assert not tier.degraded and tier.statistics().extra["breaker_opens"] >= 1
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_primary_killed_mid_batch_leaves_no_half_visible_batch(valkey_factory):
    from kvtier.tools.testing.valkey import restart_node

    cluster = valkey_factory.cluster(3)
    tier = await RemoteTier.open(cluster.url, namespace=namespace(), fingerprint=FP, concurrency=1,
                                 pipeline_max_bytes=64 << 10, timeout_s=1.0, breaker_reset_s=0.2)
    victim = cluster.nodes[1]
    try:
        items = make_items(48, 64 << 10, seed=8)  # one item per pipeline: ~16 per node
        calls = []

        def kill_on_the_fifth_pipeline(node, commands):
            calls.append(node.name)
            if len(calls) == 5:
                os.kill(victim.pid, signal.SIGKILL)

        tier.set_call_hook(kill_on_the_fifth_pipeline)
        with pytest.raises(TierIOError):
            await tier.put_many(items)
        tier.set_call_hook(None)
        assert len(calls) >= 5
        stats = tier.statistics()
        assert stats.puts == 0 and stats.errors >= 1 and stats.extra["rollbacks"] == 1
        # The surviving primaries hold nothing of the batch: the part that landed was rolled back.
        keys = [k for k, _, _ in items]
        survivors = [n for i, n in enumerate(cluster.nodes) if i != 1]
        for node in survivors:
            assert node.command("DBSIZE") == 0
        # The killed primary comes back with its slots and none of its data: still nothing visible.
        restart_node(cluster, 1)
        for _ in range(60):  # bounded: breaker reset 0.2 s, probes until the node answers
            present = await tier.contains_many(keys)
            if tier.statistics().extra["breaker_open"] == 0:
                break
            await asyncio.sleep(0.05)
        assert present == [False] * 48
        # The eviction listener of the restarted node reconnected (and asked for a listing).
        assert await wait_for(lambda: tier.statistics().extra["listener_restarts"] >= 1, timeout_s=6.0)
        # And the tier works again on the healed cluster.
        await tier.put_many(items)
        metas, bufs = await read_back(tier, items)
        assert all(m is not None for m in metas) and bytes(bufs[-1]) == bytes(items[-1][2])
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_a_moved_slot_fails_one_call_then_the_slot_map_follows(valkey_factory):
    from redis.crc import key_slot

    cluster = valkey_factory.cluster(3)
    tier = await RemoteTier.open(cluster.url, namespace=namespace(), fingerprint=FP)
    try:
        seed = 0
        items = make_items(1, 1000, seed=seed)
        while cluster.node_for_slot(key_slot(tier.rkey(items[0][0]))) is not cluster.nodes[0]:
            seed += 1
            items = make_items(1, 1000, seed=seed)
        # Resharding: the key's (empty) slot moves from the first primary to the second.
        slot = key_slot(tier.rkey(items[0][0]))
        new_owner = cluster.nodes[1].command("CLUSTER", "MYID").decode()
        cluster.nodes[1].command("CLUSTER", "BUMPEPOCH")
        for node in cluster.nodes:
            node.command("CLUSTER", "SETSLOT", slot, "NODE", new_owner)
        await asyncio.sleep(1.1)  # past the slot map's refresh rate limit
        with pytest.raises(TierIOError, match="MovedError"):
            await tier.put_many(items)  # no client-side redirect-and-retry: one call fails
        assert tier.statistics().extra["moved"] == 1
        for _ in range(40):  # bounded: the refresh it scheduled lands within a few round trips
            try:
                await tier.put_many(items)
                break
            except TierIOError:
                await asyncio.sleep(0.05)
        assert cluster.nodes[1].command("DBSIZE") == 1 and cluster.nodes[0].command("DBSIZE") == 0
        assert (await read_back(tier, items))[0] == [items[0][1]]
    finally:
        await tier.close()


def test_breaker_states():
    now = [0.0]
    b = CircuitBreaker(2, 1.0, clock=lambda: now[0])
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == CLOSED
    b.failure()
    assert b.state == OPEN and not b.allow() and b.opens == 1
    now[0] = 1.0
    assert b.state == HALF_OPEN and b.allow() and not b.allow()  # one probe
    b.failure()
    assert b.state == OPEN and b.opens == 2
    now[0] = 2.5
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()
    b.trip()
    assert b.state == OPEN


@pytest.mark.asyncio
async def test_new_keys_reach_a_watching_tier_by_notice_and_lost_notices_by_the_listing(valkey_factory):
    node = valkey_factory.node()
    ns = namespace()
    reader = await RemoteTier.open(node.url, namespace=ns, fingerprint=FP, watch_new_keys=True,
                                   listing_interval_s=None)
    writer = await RemoteTier.open(node.url, namespace=ns, fingerprint=FP)
    flags = node.command("CONFIG", "GET", "notify-keyspace-events")[b"notify-keyspace-events"]
    assert b"n" in flags and b"g" in flags  # the watching tier turned new-key and delete notices on
    arrived: List[Tuple[List[bytes], int]] = []
    reader.subscribe_arrivals(lambda keys, seq: arrived.append((sorted(keys), seq)))
    try:
        first = make_items(3, 4096, seed=61)
        await writer.put_many(first)
        assert await wait_for(lambda: sum(len(k) for k, _ in arrived) == 3, timeout_s=2.0)
        assert sorted(k for keys, _ in arrived for k in keys) == sorted(k for k, _, _ in first)
        assert reader.statistics().extra["arrivals_notified"] == 3
        # Notices lost (the server stops sending them): the listing hands the unannounced keys over,
        # once, at a later sequence.
        node.command("CONFIG", "SET", "notify-keyspace-events", "Ee")
        second = make_items(2, 4096, seed=62)
        await writer.put_many(second)
        await asyncio.sleep(0.2)
        assert sum(len(k) for k, _ in arrived) == 3
        before = arrived[-1][1]
        await reader.reconcile()
        assert arrived[-1][0] == sorted(k for k, _, _ in second) and arrived[-1][1] > before
        assert reader.statistics().extra["arrivals_listed"] == 2
        handed = list(arrived)
        await reader.reconcile()
        assert arrived == handed  # nothing handed over twice
        # A key evicted while the listing runs is not handed over as new, though the scan found it
        # (the eviction came after the cursor passed it; its notice before the listing ended).
        third = make_items(1, 4096, seed=63)
        await writer.put_many(third)
        name = reader.rkey(third[0][0])

        def evicted_during_scan(_node, commands) -> None:
            if commands and commands[0][0] == "SCAN":
                reader._on_evicted([name])  # the notice, as the listener hands it over

        reader.set_call_hook(evicted_during_scan)
        await reader.reconcile()
        reader.set_call_hook(None)
        assert arrived == handed and reader.statistics().extra["arrivals_listed"] == 2
        # Another writer's delete reaches the reader as a removal by its notice (flag g), no listing
        # needed: the key is known from its arrival on.
        node.command("CONFIG", "SET", "notify-keyspace-events", "Eeng")
        removed = []
        reader.subscribe_removals(removed.extend)
        await writer.delete_many([second[0][0]])
        assert await wait_for(lambda: [r.key for r in removed] == [second[0][0]], timeout_s=2.0)
        assert await reader.reconcile() == 0
    finally:
        await writer.close()
        await reader.close()


@pytest.mark.asyncio
async def test_sync_removals_returns_once_every_notice_sent_before_it_is_reported(valkey_factory):
    from redis.crc import key_slot

    cluster = valkey_factory.cluster(3)
    ns = namespace()
    reader = await RemoteTier.open(cluster.url, namespace=ns, fingerprint=FP, watch_new_keys=True,
                                   listing_interval_s=None, timeout_s=0.5)
    writer = await RemoteTier.open(cluster.url, namespace=ns, fingerprint=FP, listing_interval_s=None)
    removed: List[bytes] = []
    reader.subscribe_removals(lambda removals: removed.extend(r.key for r in removals))
    try:
        items = make_items(24, 4096, seed=71)
        await writer.put_many(items)
        keys = [k for k, _, _ in items]
        assert sorted(await reader.list_keys()) == sorted(keys)  # known: their removal is reported
        node_of = {k: cluster.node_for_slot(key_slot(reader.rkey(k))) for k in keys}
        assert len({n.port for n in node_of.values()}) == 3
        gone: List[bytes] = []
        for victims in (keys[0:3], keys[3:9], keys[9:10]):
            # Deleted by another client without a loop turn in between: every notice is still on
            # its way (unread on the reader's subscriptions) when the barrier is asked for.
            for key in victims:
                assert node_of[key].command("DEL", reader.rkey(key)) == 1
            await reader.sync_removals()
            await asyncio.sleep(0)  # the removal feed's subscribers are called on the loop
            gone += victims
            assert sorted(removed) == sorted(gone)
        # A stalled primary: the barrier skips it within its bound and still waits for the others.
        stalled_node = node_of[keys[10]]
        survivor = next(k for k in keys[11:] if node_of[k].port != stalled_node.port)
        with stalled_node.stalled():
            assert node_of[survivor].command("DEL", reader.rkey(survivor)) == 1
            began = time.monotonic()
            await reader.sync_removals()
            waited = time.monotonic() - began
            await asyncio.sleep(0)
        assert removed[-1] == survivor and waited < 3 * 0.5 + 1.0, waited
    finally:
        await reader.close()
        await writer.close()
