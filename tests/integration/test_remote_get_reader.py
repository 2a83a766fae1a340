"""The remote tier's GET reader (payloads straight into the caller's buffers) against real Valkey
servers: every behaviour is asserted for both readers (``direct_get`` on and off), so the fast one
keeps what redis-py's path did - bytes, misses, corrupt values, error replies, cancellation."""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest

from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.record_format import CodecConfig, encode_record
from kvtier.tiers.remote import RemoteTier
from kvtier.tools.testing.valkey import TEST_FINGERPRINT, make_items, read_back

FP = TEST_FINGERPRINT
_ns = itertools.count()


def namespace() -> str:
    return f"g{os.getpid()}-{next(_ns)}"


@pytest.fixture(params=[True, False], ids=["direct", "redis-py"])
def direct(request) -> bool:
    return request.param


def _raw(node):
    import redis

    return redis.Redis(port=int(node.port), socket_timeout=5)


@pytest.mark.asyncio
async def test_sizes_split_replies_and_absent_keys_read_back_exactly(valkey_node, direct):
    tier = await RemoteTier.open(valkey_node.url, namespace=namespace(), fingerprint=FP,
                                 codec=CodecConfig(compress=False), pipeline_max_bytes=5 << 20,
                                 direct_get=direct)
    try:
        items = [it for size, seed in ((2, 1), (1000, 2), (70_000, 3), (3 << 20, 4), (8 << 20, 5))
                 for it in make_items(2, size, seed=seed)]
        await tier.put_many(items)
        absent = make_items(2, 4096, seed=99)
        mixed = [items[0], absent[0], *items[1:], absent[1]]
        metas, bufs = await read_back(tier, mixed)
        assert metas == [None if it in absent else it[1] for it in mixed]
        assert [bytes(b) for b, it in zip(bufs, mixed) if it not in absent] == [bytes(r) for _, _, r in items]
        extra = tier.statistics().extra
        assert extra["get_direct"] == (len(items) if direct else 0)
        # A buffer of another size than the record: a mismatch, left on the server.
        metas = await tier.get_many_into([(items[2][0], memoryview(bytearray(999)))])
        assert metas == [None] and tier.statistics().mismatched == 1
        assert await tier.contains_many([items[2][0]]) == [True]
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_corrupt_payload_header_and_foreign_records_are_quarantined(valkey_node, direct):
    tier = await RemoteTier.open(valkey_node.url, namespace=namespace(), fingerprint=FP,
                                 codec=CodecConfig(compress=False), direct_get=direct)
    raw = _raw(valkey_node)
    try:
        items = make_items(4, 200_000, seed=7)
        await tier.put_many(items)
        names = [tier.rkey(k) for k, _, _ in items]
        payload_flip = bytearray(raw.get(names[0]))
        payload_flip[-5] ^= 0x01
        raw.set(names[0], bytes(payload_flip))
        header_flip = bytearray(raw.get(names[1]))
        header_flip[0] ^= 0xFF  # bad magic
        raw.set(names[1], bytes(header_flip))
        raw.set(names[2], encode_record(names[2], ChunkMeta(b"another-model", 0, 1, "bfloat16", (100_000,)),
                                        bytes(items[2][2])))
        metas, bufs = await read_back(tier, items)
        assert metas == [None, None, None, items[3][1]]
        assert bytes(bufs[3]) == bytes(items[3][2])
        stats = tier.statistics()
        assert (stats.corrupt, stats.mismatched, stats.quarantined) == (2, 1, 3)
        assert [raw.exists(n) for n in names] == [0, 0, 0, 1]
    finally:
        raw.close()
        await tier.close()


@pytest.mark.asyncio
async def test_an_error_reply_is_a_miss_and_the_connection_stays_in_step(valkey_node, direct):
    tier = await RemoteTier.open(valkey_node.url, namespace=namespace(), fingerprint=FP, direct_get=direct)
    raw = _raw(valkey_node)
    try:
        items = make_items(3, 100_000, seed=8)
        await tier.put_many(items)
        wrong = tier.rkey(items[1][0])
        raw.delete(wrong)
        raw.rpush(wrong, b"x")  # GET of a list: a WRONGTYPE error reply, mid-pipeline
        metas, bufs = await read_back(tier, items)
        assert metas == [items[0][1], None, items[2][1]]
        assert [bytes(bufs[0]), bytes(bufs[2])] == [bytes(items[0][2]), bytes(items[2][2])]
        assert tier.statistics().extra["breaker_open"] == 0
        again, _ = await read_back(tier, [items[0], items[2]])  # the same connections, still in step
        assert again == [items[0][1], items[2][1]]
    finally:
        raw.close()
        await tier.close()


@pytest.mark.asyncio
async def test_cancelled_gets_mid_read_leave_buffers_alone_and_the_node_healthy(valkey_node, direct):
    tier = await RemoteTier.open(valkey_node.url, namespace=namespace(), fingerprint=FP,
                                 codec=CodecConfig(compress=False), direct_get=direct)
    try:
        items = make_items(16, 2 << 20, seed=9)
        await tier.put_many(items)
        for delay in (0.0, 0.001, 0.005, 0.02):
            bufs = [bytearray(b"\xaa") * (2 << 20) for _ in items]
            task = asyncio.ensure_future(tier.get_many_into([(k, memoryview(b)) for (k, _, _), b in zip(items, bufs)]))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            seen = [bytes(b) for b in bufs]
            await tier.flush()
            await asyncio.sleep(0.05)
            assert [bytes(b) for b in bufs] == seen, f"written into after a cancel at {delay} s"
        stats = tier.statistics()
        assert stats.extra["breaker_open"] == 0 and stats.degraded is False
        metas, bufs = await read_back(tier, items)
        assert metas == [m for _, m, _ in items] and [bytes(b) for b in bufs] == [bytes(r) for _, _, r in items]
    finally:
        await tier.close()
