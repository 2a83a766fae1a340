"""The engine's store policy under ``store_retention_interval_tokens`` (vLLM's retention interval):
the bytes-versus-hits trade, on the seed's layout (FA b=16; SWA b=4, W=8), real LMDB, CPU tensors."""

from __future__ import annotations

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "retention, stored, diverging_hit",
    [
        (None, {0: {0, 1}, 1: {2, 3, 6, 7}}, 16),  # dense: a prompt sharing 20 tokens still hits 16
        (0, {0: {0, 1}, 1: {6, 7}}, 0),  # final boundary only: half the SWA bytes, that hit is lost
        (32, {0: {0, 1}, 1: {6, 7}}, 0),
    ],
)
async def test_retention_interval_trades_bytes_for_hits(tmp_path, retention, stored, diverging_hit):
    config = EngineConfig(cache_dir=str(tmp_path / "cache"), host_capacity_bytes=1 << 20,
                          lmdb_map_size_bytes=32 << 20, pressure_poll_interval_s=3600.0,
                          store_retention_interval_tokens=retention)
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT, num_blocks=256), config, fingerprint=b"retention")
    async with engine:
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt, expect_stored=stored)
        await scenario.consume(prompt + [5], expect_hit=32, expect_loaded={0: {0, 1}, 1: {6, 7}})
        diverging = prompt[:20] + [t + 1 for t in prompt[20:]]
        assert engine.lookup(diverging + [5]) == diverging_hit


def test_an_interval_off_the_alignment_is_refused_at_construction(tmp_path):
    config = EngineConfig(cache_dir=str(tmp_path / "cache"), store_retention_interval_tokens=24)
    with pytest.raises(ValueError, match="retention_interval must be None, 0 or a positive multiple of alignment_tokens \\(16\\), got 24"):
        OffloadEngine(LAYOUT, make_cpu_device(LAYOUT, num_blocks=64), config, fingerprint=b"retention")
