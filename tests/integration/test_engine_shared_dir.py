"""A second process (a warmup) writes the cache directory while this engine serves from it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from kvtier.engine import EngineConfig, OffloadEngine
    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

    async def main(cache_dir):
        layout = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
        config = EngineConfig(cache_dir=cache_dir, host_capacity_bytes=1 << 20)
        async with OffloadEngine(layout, make_cpu_device(layout), config, fingerprint=b"shared") as engine:
            record = await OffloadScenario(engine).produce(list(range(100, 133)))
            assert record.durable

    asyncio.run(main(sys.argv[1]))
    """
)


@pytest.mark.asyncio
async def test_chunks_another_process_writes_become_hits_after_a_refresh(tmp_path):
    layout = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
    cache_dir = str(tmp_path / "cache")
    config = EngineConfig(cache_dir=cache_dir, host_capacity_bytes=1 << 20)
    async with OffloadEngine(layout, make_cpu_device(layout), config, fingerprint=b"shared") as engine:
        prompt = list(range(100, 133)) + [7]
        assert engine.lookup(prompt) == 0
        child = subprocess.run([sys.executable, "-c", CHILD, cache_dir], capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr
        assert engine.lookup(prompt) == 0  # not yet indexed
        assert await engine.refresh_disk_index() == (6, 0)
        assert engine.lookup(prompt) == 32
        result = await engine.load(prompt, 32, OffloadScenario(engine).allocate(34))
        assert result.ok and result.chunks_from_disk == 4
        await engine.flush()
        engine.check()


@pytest.mark.asyncio
async def test_the_refresh_timer_picks_up_new_chunks(tmp_path):
    import asyncio

    layout = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
    cache_dir = str(tmp_path / "cache")
    config = EngineConfig(cache_dir=cache_dir, host_capacity_bytes=1 << 20, disk_index_refresh_interval_s=0.05)
    async with OffloadEngine(layout, make_cpu_device(layout), config, fingerprint=b"shared") as engine:
        child = subprocess.run([sys.executable, "-c", CHILD, cache_dir], capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr
        for _ in range(100):
            if engine.lookup(list(range(100, 133)) + [7]) == 32:
                break
            await asyncio.sleep(0.05)
        assert engine.lookup(list(range(100, 133)) + [7]) == 32


def test_refresh_interval_is_validated():
    with pytest.raises(ValueError, match="disk_index_refresh_interval_s"):
        EngineConfig(disk_index_refresh_interval_s=0)
    assert EngineConfig.from_dict({"disk_index_refresh_interval_s": "2.5"}).disk_index_refresh_interval_s == 2.5
