"""The pytest plugin's fixtures, used exactly as README shows a serving-process author."""

from __future__ import annotations

import pytest

from kvtier.tools.testing.faults import FaultyTier, InjectedFault


@pytest.mark.asyncio
async def test_my_scheduler_restores_the_window(kvtier_scenario):
    prompt = kvtier_scenario.tokens(33)
    await kvtier_scenario.produce(prompt, expect_stored={0: [0, 1], 1: [1, 2, 3, 5, 6, 7]})
    await kvtier_scenario.consume(prompt + [1], expect_hit=32, expect_loaded={0: [0, 1], 1: [5, 6, 7]})


@pytest.mark.asyncio
async def test_scenario_expectations_can_fail(kvtier_scenario):
    prompt = kvtier_scenario.tokens(33)
    with pytest.raises(AssertionError, match="stored"):
        await kvtier_scenario.produce(prompt, expect_stored={0: [0, 1], 1: [2, 3, 6, 7]})
    with pytest.raises(AssertionError, match="lookup hit 32 != expected 16"):
        await kvtier_scenario.consume(prompt + [1], expect_hit=16)


@pytest.mark.asyncio
async def test_back_off_under_pressure(kvtier_engine_factory, fake_nvml):
    engine = await kvtier_engine_factory(pressure_sources={"device_memory": fake_nvml})
    fake_nvml.set(0.95)
    engine.pressure.poll_once()
    handle = engine.store(list(range(33)), [[1, 2, 3], list(range(1, 10))])
    assert handle.drop_reason == "pressure"
    fake_nvml.set(0.5)
    engine.pressure.poll_once()
    handle = engine.store(list(range(33)), [[1, 2, 3], list(range(1, 10))])
    assert handle.drop_reason is None
    await handle


@pytest.mark.asyncio
async def test_faulty_tier_fails_the_nth_call_then_heals(kvtier_engine, faulty_tier):
    tier = faulty_tier(kvtier_engine.disk_tier, fail_at=1)
    assert isinstance(tier, FaultyTier)
    with pytest.raises(InjectedFault, match="call 1"):
        await tier.contains_many([b"k" * 32])
    assert await tier.contains_many([b"k" * 32]) == [False]
    assert tier.faults == 1


@pytest.mark.asyncio
async def test_factory_restart_on_the_same_directory_serves_from_disk(kvtier_engine_factory):
    from kvtier.tools.testing.scenario import OffloadScenario

    first = await kvtier_engine_factory()
    producer = OffloadScenario(first)
    prompt = producer.tokens(33)
    await producer.produce(prompt)
    await first.close()
    second = await kvtier_engine_factory(device=first.device)
    consumer = OffloadScenario(second)
    consumer.producer_bytes = producer.producer_bytes
    record = await consumer.consume(prompt + [1], expect_hit=32, expect_loaded={0: [0, 1], 1: [5, 6, 7]})
    assert record.ok
    assert second.statistics()["loaded_chunks"]["disk"] == 5


def test_a_project_without_a_loop_scope_setting_sees_no_warning_from_the_plugin(tmp_path):
    import os
    import subprocess
    import sys

    # A user's project: no pytest configuration at all, one async test using kvtier's engine fixture.
    (tmp_path / "test_user.py").write_text(
        "import pytest\n\n\n@pytest.mark.asyncio\nasync def test_engine(kvtier_engine):\n"
        "    assert kvtier_engine.lookup(list(range(40))) == 0\n"
    )
    # pytest-asyncio warns from its pytest_configure, where only Python's own filters apply: show
    # every warning as a user running with warnings on would see it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONWARNINGS"] = "default"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_user.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert '"asyncio_default_fixture_loop_scope" is unset' not in result.stdout + result.stderr
