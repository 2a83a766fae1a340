"""The engine serves while its host pools are being made: ``start`` returns with the pool factory
still held on its worker thread (a real blocking point, not a timing), lookups answer 0 and stores
are dropped, both counted as ``"starting"``; once the pools exist the engine stores and hits; a
close meanwhile waits for the pools and releases them; a pool that fails after start fails the
engine."""

from __future__ import annotations

import asyncio
import threading
from typing import List

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.errors import EngineUsageError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.host import HostSlabPool
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

LAYOUT = ModelLayout(groups=(AttentionGroup(16),))
HELD_S = 30.0


class HeldPools:
    """A ``host_pools=`` factory that holds on its worker thread until ``release()`` (or raises
    ``fail`` then)."""

    def __init__(self, fail: BaseException = None) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        self._fail = fail
        self.made: List[HostSlabPool] = []

    def __call__(self, chunk_bytes, *, device_kind, eviction) -> List[HostSlabPool]:
        self.entered.set()
        self._released.wait(HELD_S)
        if self._fail is not None:
            raise self._fail
        self.made = [HostSlabPool(n, 8, device_kind=device_kind, eviction=eviction) for n in chunk_bytes]
        return self.made

    def release(self) -> None:
        self._released.set()


def config(**overrides) -> EngineConfig:
    values = dict(host_capacity_bytes=1 << 20, pressure_poll_interval_s=3600.0, host_pools_wait_bytes=0)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.mark.asyncio
async def test_lookups_miss_and_stores_drop_while_the_pools_are_made_then_the_engine_serves():
    held = HeldPools()
    device = make_cpu_device(LAYOUT, num_blocks=32)
    engine = OffloadEngine(LAYOUT, device, config(), fingerprint=b"pools-held", host_pools=held)
    try:
        # Before the fix start awaited the pools: this wait ran out with the factory held.
        await asyncio.wait_for(engine.start(), 10)
        assert held.entered.is_set() and engine.starting
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        assert engine.lookup(prompt + [1]) == 0
        table = scenario.allocate(len(prompt))
        handle = engine.store(prompt, table)
        assert handle.drop_reason == "starting" and handle.dropped == ((0, 0), (0, 1)) and handle.scheduled == ()
        assert handle.released and await handle.wait_durable() is False
        assert await engine.prefetch(prompt + [1]) == 0
        snap = engine.metrics.snapshot()
        assert snap["misses"]["starting"] == 1 and snap["dropped"]["starting"] == 2

        held.release()
        await asyncio.wait_for(engine.flush(), 10)  # waits for the pools and the wiring
        assert not engine.starting and engine.host.pools == held.made
        await scenario.produce(prompt, expect_stored={0: {0, 1}})
        await scenario.consume(prompt + [1], expect_hit=32, expect_loaded={0: {0, 1}})
        await engine.flush()
        engine.check()
    finally:
        held.release()
        await engine.close()
    assert all(p.closed for p in held.made)


@pytest.mark.asyncio
async def test_close_while_the_pools_are_made_waits_for_them_and_releases_them():
    held = HeldPools()
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT, num_blocks=8), config(), fingerprint=b"pools-close",
                           host_pools=held)
    await engine.start()
    closing = asyncio.ensure_future(engine.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # the factory still runs on its worker thread: its slab is not ours yet
    held.release()
    await asyncio.wait_for(closing, 10)
    assert engine.closed and held.made and all(p.closed for p in held.made)


@pytest.mark.asyncio
async def test_pools_that_fail_after_start_fail_the_engine():
    held = HeldPools(fail=MemoryError("no room for the slab"))
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT, num_blocks=8), config(), fingerprint=b"pools-fail",
                           host_pools=held)
    try:
        await engine.start()
        held.release()
        await asyncio.wait_for(engine.flush(), 10)
        with pytest.raises(EngineUsageError, match="no room for the slab"):
            engine.lookup(list(range(33)))
    finally:
        await engine.close()
    assert engine.closed


@pytest.mark.asyncio
async def test_pools_made_within_the_wait_are_wired_before_start_returns():
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT, num_blocks=8), config(host_pools_wait_bytes=1 << 20),
                           fingerprint=b"pools-wait")
    async with engine:
        assert not engine.starting and engine.host.pools
