"""Copy batches pipeline on the CUDA code path, run on CPU (``RecordingBackend``): while batch n's
copy thread waits on its event (held in ``synchronize``, a real blocking point on that thread),
batch n+1 is queued on the same copy stream by the direction's second thread and completes; batch
n then completes too. Both directions."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tools.testing.device import RecordingBackend
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

LAYOUT = ModelLayout(groups=(AttentionGroup(16),))
HELD_S = 30.0


class HoldFirstSync:
    """``on_sync`` that holds the first ``synchronize`` after ``arm()`` until ``release()``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        self._armed = False
        self.held_thread = ""

    def arm(self) -> None:
        self.entered.clear()
        self._released.clear()
        self._armed = True

    def __call__(self) -> None:
        if self._armed:
            self._armed = False
            self.held_thread = threading.current_thread().name
            self.entered.set()
            self._released.wait(HELD_S)

    def release(self) -> None:
        self._released.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, HELD_S), "no copy reached its event"


@pytest.mark.asyncio
async def test_a_second_batch_queues_and_completes_while_the_first_waits_on_its_event():
    hold = HoldFirstSync()
    backend = RecordingBackend(on_sync=hold)
    device = make_cpu_device(LAYOUT, num_blocks=64, backend=backend)
    config = EngineConfig(host_capacity_bytes=1 << 20, pressure_poll_interval_s=3600.0)
    async with OffloadEngine(LAYOUT, device, config, fingerprint=b"pipelining") as engine:
        scenario = OffloadScenario(engine)
        first, second = scenario.tokens(33), scenario.tokens(33)
        tables = [scenario.allocate(33), scenario.allocate(33)]
        for prompt, table in zip((first, second), tables):
            scenario.fill_blocks(engine.request_keys(prompt), table)
        try:
            # Device -> host: the first store's thread waits on its event.
            hold.arm()
            held = engine.store(first, tables[0])
            await hold.wait_entered()
            backend.log.clear()
            # With one thread per direction the second batch would wait behind the first: this
            # wait would run out.
            await asyncio.wait_for(engine.store(second, tables[1]).wait_released(), 10)
            assert not held.released
            ops = backend.ops("copy", "record", "sync")
            # Its 2 chunks went to consecutive host slots: one host copy for both.
            assert ops.count(("copy", "copy1", None)) == 1 and ops[-2:] == [("record", "copy1", ops[-1][2]),
                                                                            ("sync", "copy1", ops[-1][2])]
            assert {t for *_, t in backend.log if t.startswith("kvtier-d2h")} - {hold.held_thread}
            hold.release()
            await asyncio.wait_for(held.wait_released(), 10)
            await engine.flush()

            # Host -> device: the same with two loads.
            hold.arm()
            loading = asyncio.ensure_future(engine.load(first + [1], 32, scenario.allocate(33)))
            await hold.wait_entered()
            assert (await asyncio.wait_for(engine.load(second + [1], 32, scenario.allocate(33)), 10)).ok
            assert not loading.done()
            hold.release()
            assert (await asyncio.wait_for(loading, 10)).ok
        finally:
            hold.release()
        await engine.flush()
        engine.check()
