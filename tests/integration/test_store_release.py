"""Store until released: the copy starts when ``store`` is called, and the caller's device blocks
are released only after their bytes reached the host slots.

A device view whose gather waits at a gate (a real blocking point on the engine's copy thread)
stands between the engine and real CPU copies, so the test sees what was released while a copy
was still held.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.device import DeviceKVView
from kvtier.tools.testing.scenario import OffloadScenario

LAYOUT = ModelLayout(groups=(AttentionGroup(16, blocks_per_chunk=2),))
HELD_S = 10.0


class GatedView(DeviceKVView):
    """A CPU view whose device -> host batches each wait for ``gate`` before copying; ``entered``
    is set by the first batch that reached it, ``copied`` counts the batches whose bytes moved."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.copied = 0

    def gather_many_groups(self, items, **kwargs):
        self.entered.set()
        if not self.gate.wait(HELD_S):
            raise RuntimeError("the test never opened the gate")
        handle = super().gather_many_groups(items, **kwargs)
        self.copied += 1
        return handle


@pytest.mark.asyncio
async def test_the_copy_starts_at_store_and_blocks_are_released_only_after_their_bytes_moved():
    layers = [torch.randint(-(2 ** 15), 2 ** 15, (64, 2, 16, 2, 4), dtype=torch.int16).view(torch.bfloat16)
              for _ in range(3)]
    view = GatedView(LAYOUT, [layers])
    config = EngineConfig(host_capacity_bytes=1 << 20, pressure_poll_interval_s=3600.0)
    async with OffloadEngine(LAYOUT, view, config, fingerprint=b"release") as engine:
        scenario = OffloadScenario(engine)
        prompts = [scenario.tokens(96), scenario.tokens(64)]
        tables = [scenario.allocate(96), scenario.allocate(64)]
        handles = [engine.store(prompt, table) for prompt, table in zip(prompts, tables)]
        # No loop turn since store() returned: the copy thread already holds the first batch (a copy
        # handed over by the store's task would only start once the loop ran it).
        assert view.entered.wait(HELD_S), "the first store's copy did not start within store()"
        await asyncio.sleep(0.05)  # loop turns: the engine's tasks run, the copies stay held
        assert [h.released for h in handles] == [False, False] and view.copied == 0
        view.gate.set()
        await asyncio.wait_for(asyncio.gather(*(h.wait_released() for h in handles)), HELD_S)
        assert view.copied == 2
        # Released after the bytes moved: every stored chunk's slot holds its blocks, bit for bit,
        # and overwriting the device blocks now (the caller may) changes no host byte.
        expected = {}
        for prompt, table, handle in zip(prompts, tables, handles):
            keys = engine.request_keys(prompt).keys[0]
            assert sorted(handle.scheduled) == [(0, c) for c in range(len(prompt) // 32)]
            for _, chunk in handle.scheduled:
                blocks = table[0][2 * chunk : 2 * chunk + 2]
                expected[keys[chunk]] = torch.cat([layer[blocks].contiguous().view(torch.uint8).reshape(-1)
                                                   for layer in layers])
        for layer in layers:
            layer.view(torch.int16).fill_(7)
        for key, want in expected.items():
            assert torch.equal(engine.host.view(engine.host.entries[key]), want)
        await engine.flush()
        engine.check()
