"""The tier contract (``kvtier.tiers.base.ChunkTier``): one suite, run against every tier.

Every test takes the ``kind`` fixture, parametrized over ``TIERS``: the LMDB tier, the file tier,
and the fault wrapper (``kvtier.tools.testing.faults.FaultyTier``, no faults scripted) around each. A tier
is correct when it passes every test here; two tiers cannot drift apart quietly.

Adding a tier (the remote tier, a chained tier): append a ``TierKind`` to ``TIERS`` (or, from a
module that owns a server fixture, parametrize ``kind`` with your own ``TierKind`` through
``pytest_generate_tests`` or a ``conftest.py`` override of the ``kind`` fixture). A ``TierKind``
names three things:

- ``open(path, capacity_bytes)``: an async factory returning a fresh, empty tier (``path`` is a
  private temporary directory; ignore it if the tier keeps its bytes elsewhere, but then start
  empty). Capacity is in stored (encoded) bytes; ``None`` means unbounded.
- ``corrupt(tier, key)``: blocking; flips a byte of the stored record ``key`` so that the next read
  must detect it (``kvtier.tools.testing.faults.corrupt_stored_record`` knows LMDB and files).
- ``break_writes(tier)``: makes every later write fail underneath (as a dying disk or a dropped
  connection would) and returns a function that heals it.

The suite's budget in the default run is a few seconds per tier (tiny records, small batches).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

import pytest

from kvtier.errors import ClosedError, TierIOError
from kvtier.tiers.base import (
    KEY_MAX_BYTES,
    STATISTICS_FIELDS,
    ChunkMeta,
    ChunkTier,
    KeySnapshot,
    PutAbortedError,
    Removal,
    TierStatistics,
)
from kvtier.tiers.deferred import DeferredTier
from kvtier.tiers.files import FileTier
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig, encode_record
from kvtier.tools.testing.faults import FaultyTier, corrupt_stored_record, inject_io_faults, remove_io_faults


@dataclass(frozen=True)
class TierKind:
    name: str
    open: Callable[[Path, Optional[int]], Awaitable[ChunkTier]]
    corrupt: Callable[[ChunkTier, bytes], None]
    break_writes: Callable[[ChunkTier], Callable[[], None]]
    # False for a tier whose capacity is not its own (the remote's is the server's maxmemory, its
    # evictions the server's: tests/integration/test_remote_tier.py covers them).
    bounded: bool = True


async def _open_lmdb(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
    # the defaults: records of DEFAULT_SEGMENT_THRESHOLD_BYTES (128 KiB) and more in segments
    return await LmdbTier.open(path, capacity_bytes=capacity_bytes, map_size_bytes=8 << 20)


async def _open_lmdb_inline(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
    # segments off: every record inside LMDB (as caches written before segments were the default)
    return await LmdbTier.open(path, capacity_bytes=capacity_bytes, map_size_bytes=8 << 20, segment_threshold_bytes=None)


async def _open_lmdb_segments(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
    # every record in a segment file (tiers/lmdb/segments.py), the index in LMDB
    return await LmdbTier.open(path, capacity_bytes=capacity_bytes, map_size_bytes=8 << 20, segment_threshold_bytes=1)


async def _open_files(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
    return await FileTier.open(path, capacity_bytes=capacity_bytes, io_threads=2)


async def _open_deferred(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
    # handed out while the LMDB tier is still opening (a start after an unclean close): the first
    # calls meet the open in progress
    return DeferredTier(asyncio.ensure_future(_open_lmdb(path, capacity_bytes)), name="lmdb")


def _wrapped(open_inner: Callable[[Path, Optional[int]], Awaitable[ChunkTier]]):
    async def open_faulty(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
        return FaultyTier(await open_inner(path, capacity_bytes))

    return open_faulty


def _break_disk(write_ops: Sequence[str]) -> Callable[[ChunkTier], Callable[[], None]]:
    def break_writes(tier: ChunkTier) -> Callable[[], None]:
        inject_io_faults(tier, fail_from=1, ops=write_ops)
        return lambda: remove_io_faults(tier)

    return break_writes


_LMDB_WRITES = _break_disk(("commit",))
_FILE_WRITES = _break_disk(("fsync",))

async def _open_remote(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
    from kvtier.tiers.remote import RemoteTier
    from kvtier.tools.testing.valkey import shared_node

    # A fresh namespace per tier: the shared server starts "empty" for this tier.
    return await RemoteTier.open(shared_node().url, namespace=f"contract-{os.getpid()}-{path.name}-{path.parent.name}"[:64])


def _remote_of(tier: ChunkTier) -> ChunkTier:
    return tier.tiers[1] if hasattr(tier, "tiers") else tier  # a chain's remote, or the tier itself


def _corrupt_remote(tier: ChunkTier, key: bytes) -> None:
    from kvtier.tools.testing.valkey import shared_node

    node, name = shared_node(), _remote_of(tier).rkey(key)  # type: ignore[attr-defined]
    value = bytearray(node.command("GET", name))
    value[-1] ^= 0xFF
    node.command("SET", name, bytes(value))


def _break_remote_writes(tier: ChunkTier) -> Callable[[], None]:
    from redis.exceptions import ConnectionError as RedisConnectionError

    def refuse_stores(node, commands) -> None:
        if any(c[0] == "SET" for c in commands):
            raise RedisConnectionError("injected: connection reset by peer")

    _remote_of(tier).set_call_hook(refuse_stores)  # type: ignore[attr-defined]
    return lambda: _remote_of(tier).set_call_hook(None)  # type: ignore[attr-defined]


async def _open_chain(path: Path, capacity_bytes: Optional[int]) -> ChunkTier:
    from kvtier.tiers.chain import ChainedTier

    return ChainedTier([await _open_lmdb(path / "lmdb", None), await _open_remote(path, None)])


def _corrupt_chain(tier: ChunkTier, key: bytes) -> None:
    corrupt_stored_record(tier.tiers[0], key)  # type: ignore[attr-defined]
    _corrupt_remote(tier, key)


def _break_chain_writes(tier: ChunkTier) -> Callable[[], None]:
    # Both tiers: a first tier failing alone still lands the batch in the remote (the put succeeds).
    # The remote refuses it as a server whose value limit is below every record (no breaker opens,
    # so healing is immediate).
    heal_lmdb = _LMDB_WRITES(tier.tiers[0])  # type: ignore[attr-defined]
    remote = _remote_of(tier)
    limit, remote._max_value_bytes = remote._max_value_bytes, 1  # type: ignore[attr-defined]

    def heal() -> None:
        heal_lmdb()
        remote._max_value_bytes = limit  # type: ignore[attr-defined]

    return heal


TIERS: List[TierKind] = [
    TierKind("lmdb", _open_lmdb, corrupt_stored_record, _LMDB_WRITES),
    TierKind("lmdb-segments", _open_lmdb_segments, corrupt_stored_record, _LMDB_WRITES),
    TierKind("lmdb-inline", _open_lmdb_inline, corrupt_stored_record, _LMDB_WRITES),
    TierKind("files", _open_files, corrupt_stored_record, _FILE_WRITES),
    TierKind("deferred-lmdb", _open_deferred, lambda t, k: corrupt_stored_record(t.opened, k),
             lambda t: _LMDB_WRITES(t.opened)),
    TierKind("faulty-lmdb", _wrapped(_open_lmdb), lambda t, k: corrupt_stored_record(t.inner, k), _LMDB_WRITES),
    TierKind("faulty-files", _wrapped(_open_files), lambda t, k: corrupt_stored_record(t.inner, k), _FILE_WRITES),
    TierKind("remote", _open_remote, _corrupt_remote, _break_remote_writes, bounded=False),
    TierKind("chain-lmdb-remote", _open_chain, _corrupt_chain, _break_chain_writes, bounded=False),
]


@pytest.fixture(params=TIERS, ids=lambda kind: kind.name)
def kind(request: pytest.FixtureRequest) -> TierKind:
    return request.param


@pytest.fixture
def opened(kind: TierKind, tmp_path: Path):
    """``async with opened(capacity_bytes=None) as tier``: a fresh tier of this kind, closed on the
    test's own loop when the block ends."""
    count = [0]

    @contextlib.asynccontextmanager
    async def open_tier(capacity_bytes: Optional[int] = None) -> AsyncIterator[ChunkTier]:
        count[0] += 1
        tier = await kind.open(tmp_path / f"tier{count[0]}", capacity_bytes)
        try:
            yield tier
        finally:
            await tier.close()

    return open_tier


# ------------------------------------------------------------------------------------------ helpers

META = ChunkMeta(b"contract", 0, 0, "uint8", (0,))


def key_of(i: int, length: int = 32) -> bytes:
    return (i.to_bytes(8, "little") * (length // 8 + 1))[:length]


def payload(i: int, nbytes: int) -> bytearray:
    return bytearray(os.urandom(nbytes)) if i < 0 else bytearray((i * 7 + j) % 251 for j in range(nbytes))


def item(key: bytes, data: bytearray, chunk_index: int = 0):
    return key, dataclasses.replace(META, chunk_index=chunk_index, shape=(len(data),)), memoryview(data)


def four_records(kind: TierKind, size: int) -> int:
    """A capacity of exactly four records of ``size`` payload bytes (skips a kind with no capacity
    of its own)."""
    if not kind.bounded:
        pytest.skip(f"{kind.name}: no capacity of its own (server evictions: test_remote_tier.py)")
    record = len(encode_record(key_of(0), item(key_of(0), payload(0, size))[1], memoryview(payload(0, size)), CodecConfig()))
    return 4 * record


async def read(tier: ChunkTier, keys: Sequence[bytes], nbytes: int) -> Tuple[List[Optional[ChunkMeta]], List[bytes]]:
    bufs = [bytearray(nbytes) for _ in keys]
    metas = await tier.get_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)])
    return metas, [bytes(b) for b in bufs]


class Removals:
    """A subscriber that records every report, and the thread it ran on."""

    def __init__(self, tier: ChunkTier) -> None:
        self.seen: List[Removal] = []
        self.loop = asyncio.get_running_loop()
        self.wrong_loop = 0
        tier.subscribe_removals(self)

    def __call__(self, removals: Sequence[Removal]) -> None:
        try:
            if asyncio.get_running_loop() is not self.loop:
                self.wrong_loop += 1
        except RuntimeError:
            self.wrong_loop += 1
        self.seen.extend(removals)

    def of(self, key: bytes) -> List[Removal]:
        return [r for r in self.seen if r.key == key]


async def settle(tier: ChunkTier) -> None:
    """Let queued writes land and their reports (call_soon_threadsafe) run."""
    await tier.flush()
    for _ in range(3):
        await asyncio.sleep(0)


# -------------------------------------------------------------------------------------------- tests


@pytest.mark.asyncio
async def test_round_trip_is_bitwise_and_sequences_increase(opened) -> None:
    async with opened() as tier:
        keys = [key_of(1, 1), key_of(2), key_of(3, KEY_MAX_BYTES), key_of(4, 101)]
        datas = [payload(i, 3000) for i in range(len(keys))]
        first = await tier.put_many([item(k, d, i) for i, (k, d) in enumerate(zip(keys, datas))])
        assert isinstance(first, int) and first >= 1 and tier.sequence >= first
        metas, got = await read(tier, keys, 3000)
        assert got == [bytes(d) for d in datas]
        assert [m.chunk_index for m in metas] == [0, 1, 2, 3]  # type: ignore[union-attr]
        assert await tier.contains_many(keys + [key_of(9)]) == [True] * 4 + [False]
        assert sorted(await tier.list_keys()) == sorted(keys)
        # Overwrite one key, add another: a later mutation has a larger sequence.
        second = await tier.put_many([item(keys[1], payload(50, 3000)), item(key_of(5), payload(5, 10))])
        assert second > first
        _, got = await read(tier, [keys[1]], 3000)
        assert got == [bytes(payload(50, 3000))]
        assert await tier.put_many([]) == tier.sequence  # nothing new: the sequence as it is
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_one_key_rule_in_every_method(opened) -> None:
    async with opened() as tier:
        buf = memoryview(bytearray(8))
        calls = {
            "put_many": lambda k: tier.put_many([item(k, bytearray(8))]),
            "get_many_into": lambda k: tier.get_many_into([(k, buf)]),
            "contains_many": lambda k: tier.contains_many([k]),
            "delete_many": lambda k: tier.delete_many([k]),
        }
        for name, call in calls.items():
            for bad in (b"", bytes(KEY_MAX_BYTES + 1)):
                with pytest.raises(ValueError, match=rf"^chunk key length must be 1\.\.{KEY_MAX_BYTES}, got {len(bad)}$"):
                    await call(bad)
            with pytest.raises(TypeError, match="^chunk keys are bytes, not str$"):
                await call("abc")
        assert await tier.list_keys() == [] and tier.statistics().puts == 0, "a refused call did something"


@pytest.mark.asyncio
async def test_put_is_all_or_nothing_and_a_broken_write_degrades(kind: TierKind, opened) -> None:
    async with opened() as tier:
        await tier.put_many([item(key_of(1), payload(1, 2000))])
        heal = kind.break_writes(tier)
        batch = [item(key_of(i), payload(i, 2000)) for i in range(2, 12)] + [item(key_of(1), payload(99, 2000))]
        with pytest.raises(TierIOError):
            await tier.put_many(batch)
        assert tier.degraded and tier.statistics().degraded
        assert tier.statistics().errors >= 1
        assert await tier.contains_many([key_of(i) for i in range(2, 12)]) == [False] * 10
        metas, got = await read(tier, [key_of(i) for i in range(2, 12)], 2000)
        assert metas == [None] * 10
        heal()
        # The key the failed batch would have overwritten: the old record, or (file tier: its file
        # was already replaced) a miss reported as removed -- never the failed batch's bytes.
        metas, got = await read(tier, [key_of(1)], 2000)
        assert got[0] != bytes(payload(99, 2000)) or metas[0] is None
        await tier.put_many(batch)
        assert not tier.degraded and not tier.statistics().degraded
        metas, got = await read(tier, [key_of(i) for i in range(2, 12)], 2000)
        assert got == [bytes(payload(i, 2000)) for i in range(2, 12)]
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_removals_are_reported_once_with_their_sequence(kind: TierKind, opened) -> None:
    size = 4000
    async with opened(capacity_bytes=four_records(kind, size)) as tier:
        removals = Removals(tier)
        puts: Dict[bytes, int] = {}
        for i in range(4):
            puts[key_of(i)] = await tier.put_many([item(key_of(i), payload(i, size))])
        await read(tier, [key_of(0)], size)  # 0 becomes the most recently used: 1 is the oldest
        fifth = await tier.put_many([item(key_of(4), payload(4, size))])
        await settle(tier)
        assert [(r.key, r.reason) for r in removals.seen] == [(key_of(1), "evicted")]
        evicted = removals.seen[0]
        assert puts[key_of(1)] < evicted.sequence <= fifth

        # Quarantine: a corrupt record is a miss, counted, reported once.
        await asyncio.to_thread(kind.corrupt, tier, key_of(2))
        metas, _ = await read(tier, [key_of(2)], size)
        assert metas == [None]
        await settle(tier)
        assert [r.reason for r in removals.of(key_of(2))] == ["quarantined"]
        quarantined = removals.of(key_of(2))[0]
        assert quarantined.sequence > puts[key_of(2)]
        stats = tier.statistics()
        assert (stats.corrupt, stats.quarantined, stats.evictions) == (1, 1, 1)

        # Delete: reported as deleted, counted; a second delete of the same key reports nothing.
        assert await tier.delete_many([key_of(3), key_of(3), key_of(77)]) == 1
        assert await tier.delete_many([key_of(3)]) == 0
        await settle(tier)
        assert [r.reason for r in removals.of(key_of(3))] == ["deleted"]
        assert removals.of(key_of(3))[0].sequence > quarantined.sequence
        assert tier.statistics().deletes == 1

        # The ordering rule: the later mutation wins.
        again = await tier.put_many([item(key_of(1), payload(11, size))])
        assert again > evicted.sequence
        metas, got = await read(tier, [key_of(1)], size)
        assert got == [bytes(payload(11, size))]
        assert removals.wrong_loop == 0
        assert len(removals.seen) == len({(r.key, r.sequence) for r in removals.seen}), "reported twice"
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_a_touch_counts_as_a_use_for_eviction(kind: TierKind, opened) -> None:
    """``touch_many`` (a use served from a faster copy above) moves a held key young as a read
    would; unknown keys are ignored."""
    size = 4000
    async with opened(capacity_bytes=four_records(kind, size)) as tier:
        removals = Removals(tier)
        for i in range(4):
            await tier.put_many([item(key_of(i), payload(i, size))])
        tier.touch_many([key_of(1), key_of(0), key_of(99)])  # oldest first now: 2, 3, 1, 0
        for i in range(4, 8):
            await tier.put_many([item(key_of(i), payload(i, size))])
            await settle(tier)
        assert [r.key for r in removals.seen] == [key_of(2), key_of(3), key_of(1), key_of(0)]
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_snapshot_reflects_every_mutation_up_to_its_sequence(opened) -> None:
    async with opened() as tier:
        removals = Removals(tier)
        s1 = await tier.put_many([item(key_of(i), payload(i, 500)) for i in range(6)])
        await tier.delete_many([key_of(0), key_of(1)])
        await settle(tier)
        snap = await tier.snapshot_keys()
        assert isinstance(snap, KeySnapshot)
        assert snap.keys == frozenset(key_of(i) for i in range(2, 6))
        assert snap.sequence >= s1 and all(r.sequence <= snap.sequence for r in removals.seen)
        later = await tier.put_many([item(key_of(0), payload(0, 500))])
        assert later > snap.sequence
        snap2 = await tier.snapshot_keys()
        assert key_of(0) in snap2.keys and snap2.sequence >= later
        assert set(await tier.list_keys()) == snap2.keys


@pytest.mark.asyncio
async def test_statistics_use_the_shared_names(kind: TierKind, opened) -> None:
    capacity = 1 << 20 if kind.bounded else None
    async with opened(capacity_bytes=capacity) as tier:
        await tier.put_many([item(key_of(i), payload(i, 100)) for i in range(3)])
        await read(tier, [key_of(0), key_of(9)], 100)
        stats = tier.statistics()
        assert isinstance(stats, TierStatistics)
        assert tuple(f.name for f in dataclasses.fields(stats)) == STATISTICS_FIELDS
        flat = stats.as_dict()
        assert set(STATISTICS_FIELDS) - {"extra"} <= set(flat)
        assert all(isinstance(v, float) for v in flat.values())
        assert (stats.records, stats.puts, stats.put_batches) == (3, 3, 1)
        assert (stats.gets, stats.hits, stats.misses) == (2, 1, 1)
        assert stats.capacity_bytes == tier.capacity_bytes == capacity
        assert 0 < stats.bytes <= 1 << 20 and flat["bytes"] == float(stats.bytes)
        assert not set(stats.extra) & set(STATISTICS_FIELDS), "a shared name hidden in extra"


@pytest.mark.asyncio
async def test_cancelled_calls_keep_the_buffer_rule(opened) -> None:
    """A cancelled put ends only when its buffers are no longer read, and still lands; a cancelled
    get ends only when nothing writes into its buffers any more."""
    async with opened() as tier:
        n, size = 24, 256 << 10  # 6 MiB: several encode/decode slices
        datas = [payload(-1, size) for _ in range(n)]
        keys = [key_of(100 + i) for i in range(n)]
        expected = [bytes(d) for d in datas]
        task = asyncio.ensure_future(tier.put_many([item(k, d) for k, d in zip(keys, datas)]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for d in datas:  # the caller reuses its buffers at once
            d[:] = bytes(size)
        await settle(tier)
        await asyncio.sleep(0.05)
        _, got = await read(tier, keys, size)
        assert got == expected, "the cancelled put did not land intact"

        bufs = [bytearray(b"\xaa") * size for _ in range(n)]
        task = asyncio.ensure_future(tier.get_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        seen = [bytes(b) for b in bufs]
        await settle(tier)
        await asyncio.sleep(0.1)
        assert [bytes(b) for b in bufs] == seen, "the tier wrote into buffers after the call ended"


@pytest.mark.asyncio
async def test_a_cancelled_flush_stops_only_its_own_wait(opened) -> None:
    """Cancelling ``flush`` while a put is in flight must not cancel the put: its caller still gets
    the put's own result and the records land (the remote tier once waited with ``gather``, whose
    cancellation cancels the tier's tasks)."""
    async with opened() as tier:
        n, size = 16, 256 << 10
        keys = [key_of(300 + i) for i in range(n)]
        datas = [payload(300 + i, size) for i in range(n)]
        put = asyncio.ensure_future(tier.put_many([item(k, d) for k, d in zip(keys, datas)]))
        await asyncio.sleep(0)
        flush = asyncio.ensure_future(tier.flush())
        await asyncio.sleep(0)
        flush.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flush
        sequence = await put  # not cancelled by the flush's cancellation
        assert isinstance(sequence, int) and sequence > 0
        _, got = await read(tier, keys, size)
        assert got == [bytes(d) for d in datas]


@pytest.mark.asyncio
async def test_close_twice_then_every_call_is_closed_error(opened) -> None:
    async with opened() as tier:
        await tier.put_many([item(key_of(1), payload(1, 10))])
        assert await tier.check() == []
    await tier.close()  # the block closed it once
    buf = memoryview(bytearray(10))
    for call in (
        lambda: tier.put_many([item(key_of(2), payload(2, 10))]),
        lambda: tier.get_many_into([(key_of(1), buf)]),
        lambda: tier.contains_many([key_of(1)]),
        lambda: tier.delete_many([key_of(1)]),
        tier.list_keys,
        tier.snapshot_keys,
    ):
        with pytest.raises(ClosedError):
            await call()


@pytest.mark.asyncio
async def test_closed_says_whether_close_has_begun(opened) -> None:
    async with opened() as tier:
        assert tier.closed is False
    assert tier.closed is True


@pytest.mark.asyncio
async def test_a_two_phase_put_lands_only_after_its_gate_and_is_dropped_when_the_gate_fails(opened) -> None:
    async with opened() as tier:
        loop = asyncio.get_running_loop()
        with pytest.raises(TypeError):
            tier.start_put([("not bytes", META, memoryview(bytearray(1)))])  # type: ignore[list-item]
        kept, dropped = key_of(1), key_of(2)
        gate: "asyncio.Future[None]" = loop.create_future()
        buffers_read, landed = tier.start_put([item(kept, payload(1, 3000))], after=gate)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not landed.done() and await tier.contains_many([kept]) == [False]
        gate.set_result(None)
        sequence = await landed
        assert buffers_read.done() and isinstance(sequence, int) and sequence >= 1
        _, got = await read(tier, [kept], 3000)
        assert got == [bytes(payload(1, 3000))]

        failed: "asyncio.Future[None]" = loop.create_future()
        buffers_read, landed = tier.start_put([item(dropped, payload(2, 3000))], after=failed)
        failed.set_exception(TierIOError("the first tier's put failed"))
        with pytest.raises(PutAbortedError, match="the write it follows failed"):
            await landed
        await asyncio.wait([buffers_read])  # the buffers are free once the batch was dropped
        assert await tier.contains_many([kept, dropped]) == [True, False]
