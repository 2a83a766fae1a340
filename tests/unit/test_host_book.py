"""HostBook, the one owner of the engine's host-side bookkeeping, narrated on tiny real pools.

Two groups, two slots each (real ``HostSlabPool``s on CPU, a real ``DiskIndex``, ``EventLog``,
``EngineMetrics`` and ``DurableWatch``): allocation is all or nothing across groups, a pin is
counted once (by the slot's pool), a dropped entry keeps its slot until its last pin goes, fences
name the batches that touch a block, and ``problems()`` reports what disagrees.
"""

from __future__ import annotations

import asyncio

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.engine.disk_index import DiskIndex
from kvtier.engine.durable import DurableWatch
from kvtier.engine.events import EventLog
from kvtier.engine.host_book import HostBook
from kvtier.engine.lifecycle import HostState
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.records import ChunkEntry, StoreHandle
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.host import HostSlabPool
from kvtier.tools.testing.scenario import make_cpu_device


def key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def make_book(loop, slots=(2, 2)):
    index = DiskIndex()
    metrics = EngineMetrics()
    watch = DurableWatch()
    book = HostBook(b"fp", [64, 32], [16, 16], [("uint8", (64,)), ("uint8", (32,))], index=index, watch=watch,
                    metrics=metrics, events=EventLog(100))
    book.open([HostSlabPool(64, slots[0]), HostSlabPool(32, slots[1])])
    return book, index, watch, metrics


def ready_entries(book, wanted):
    slots = book.allocate(g for g, _, _ in wanted)
    entries = book.add_entries(wanted, HostState.LOADING, slots)
    for entry in entries:
        book.unpin(entry)
        book.settle_ready(entry)
        book.resolve(entry, None)
    return entries


@pytest.mark.asyncio
async def test_a_pin_is_counted_once_by_the_slots_pool():
    book, *_ = make_book(asyncio.get_running_loop())
    (entry,) = book.add_entries([(0, 0, key("a"))], HostState.LOADING, book.allocate([0]))
    assert "pins" not in ChunkEntry.__dataclass_fields__
    assert book.pins(entry) == 1 == book.pools[0].pin_count(entry.slot)  # the copy's own pin
    book.pin(entry)
    assert book.pools[0].pin_count(entry.slot) == 2
    book.unpin(entry)
    book.unpin(entry)
    assert book.pins(entry) == 0
    book.settle_ready(entry)
    assert book.problems(idle=True, queued_ok=False) == []
    book.close()


@pytest.mark.asyncio
async def test_allocation_is_all_or_nothing_across_groups():
    book, index, _, metrics = make_book(asyncio.get_running_loop())
    a, b, c = ready_entries(book, [(0, 0, key("a")), (0, 1, key("b")), (1, 0, key("c"))])
    book.pin(c)  # group 1: one slot free, the other pinned
    # Group 0 could evict both its chunks, group 1 cannot give two slots: nothing changes anywhere.
    assert book.allocate([0, 0, 1, 1]) is None
    assert set(book.entries) == {key("a"), key("b"), key("c")} and not a.dead and not b.dead
    assert metrics.snapshot()["dropped"].get("evicted", 0) == 0
    # One slot per group fits: group 0 evicts its least recently used chunk, counted as dropped
    # since it is not on disk, and the eviction is an event.
    index.replace_all([key("b")], None)
    granted = book.allocate([0, 1])
    assert sorted(granted) == [0, 1] and a.dead and key("a") not in book.entries
    assert metrics.snapshot()["dropped"]["evicted"] == 1
    book.unpin(c)
    book.close()


@pytest.mark.asyncio
async def test_a_dropped_entry_keeps_its_slot_until_its_last_pin_and_its_waiters_learn_at_once():
    loop = asyncio.get_running_loop()
    book, _, watch, metrics = make_book(loop)
    (entry,) = book.add_entries([(1, 0, key("p"))], HostState.PENDING, book.allocate([1]))
    handle = StoreHandle(loop, [(1, 0)], (), (), None)
    watch.watch(handle, [key("p")])
    book.drop(entry, "copy_error")
    assert entry.dead and key("p") not in book.entries
    assert handle.durable_known and await handle.wait_durable() is False
    assert metrics.snapshot()["dropped"]["copy_error"] == 1
    assert book.pools[1].num_free == 1  # still held: the copy's pin
    book.unpin(entry)
    assert book.pools[1].num_free == 2
    assert book.problems(idle=True, queued_ok=False) == []
    book.close()


@pytest.mark.asyncio
async def test_fences_name_the_batches_that_touch_a_block_and_problems_report_what_is_left():
    loop = asyncio.get_running_loop()
    book, *_ = make_book(loop)
    done = loop.create_future()
    book.mark_busy([(0, [3]), (1, [3, None])], done)
    assert book.busy_with(frozenset({(1, 3)})) == [done]
    assert book.busy_with(frozenset({(0, 4)})) == []
    (entry,) = book.add_entries([(0, 0, key("q"))], HostState.LOADING, book.allocate([0]))
    assert book.problems(idle=True, queued_ok=False) == [
        f"entry {key('q').hex()[:12]} stuck in loading",
        "group 0: 1 slots pinned while idle",
        "2 device blocks still fenced while idle",
    ]
    assert book.problems(idle=False, queued_ok=False) == []
    done.set_result(None)
    await asyncio.sleep(0)  # the done-callback clears the mark
    book.unpin(entry)
    book.settle_ready(entry)
    assert book.busy_with(frozenset({(1, 3)})) == []
    assert book.state_counts() == {"pending": 0, "queued": 0, "spilling": 0, "ready": 1, "loading": 0, "disk": 0}
    assert book.problems(idle=True, queued_ok=False) == []
    book.close()


@pytest.mark.asyncio
async def test_the_engine_takes_its_host_pools_from_a_factory():
    layout = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
    device = make_cpu_device(layout)
    calls = []

    def pools(chunk_bytes, *, device_kind, eviction):
        calls.append((list(chunk_bytes), device_kind, eviction))
        return [HostSlabPool(n, count, device_kind=device_kind, eviction=eviction) for n, count in zip(chunk_bytes, (3, 5))]

    config = EngineConfig(host_capacity_bytes=1 << 20, pressure_poll_interval_s=3600.0)
    async with OffloadEngine(layout, device, config, fingerprint=b"pools", host_pools=pools) as engine:
        assert [p.num_slots for p in engine.host.pools] == [3, 5]
        assert calls == [([device.chunk_nbytes(0), device.chunk_nbytes(1)], "cpu", config.host_policy())]
        engine.check()
    assert all(p.closed for p in engine.host.pools)


def test_event_log_extend_keeps_the_newest_and_counts_what_it_dropped() -> None:
    from types import SimpleNamespace

    drops = []
    log = EventLog(3, on_drop=drops.append)
    log.append("removed", b"a", 0, "disk")
    log.extend("stored", [SimpleNamespace(key=k, group_index=g) for k, g in ((b"b", 0), (b"c", 1), (b"d", 0))], "host")
    assert [(e.kind, e.key, e.group_index, e.tier) for e in log.take()] == [
        ("stored", b"b", 0, "host"), ("stored", b"c", 1, "host"), ("stored", b"d", 0, "host")]
    assert log.dropped == 1 and drops == [1]
    log.extend("stored", [], "host")
    assert len(log) == 0 and drops == [1]
