"""The engine's waiting helpers and loop supervision (engine/tasks.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.engine.tasks import Supervised, settle, wait_all

from cancel_checks import assert_cancel_waits_for_the_work


@pytest.mark.asyncio
async def test_settle_waits_for_the_work_even_when_its_waiter_is_cancelled():
    release = asyncio.Event()
    finished = []

    async def work():
        await release.wait()
        finished.append(True)

    waiter = asyncio.ensure_future(settle(work()))
    await asyncio.sleep(0)
    await assert_cancel_waits_for_the_work(waiter, release.set, held_s=0.01,
                                           left_early="settle returned while the work still ran")
    assert finished == [True]


@pytest.mark.asyncio
async def test_cancelling_wait_all_cancels_none_of_the_tasks():
    release = asyncio.Event()
    task = asyncio.ensure_future(release.wait())
    waiter = asyncio.ensure_future(wait_all([task]))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    assert not task.cancelled()
    release.set()
    await task


@pytest.mark.asyncio
async def test_crashes_far_apart_are_not_in_a_row():
    now = [0.0]
    crashes, gave_up = [], []
    runs = {"n": 0}

    async def loop():
        runs["n"] += 1
        if runs["n"] <= 5:
            now[0] += 100.0  # each crash long after the one before
            raise RuntimeError(f"crash {runs['n']}")
        await asyncio.sleep(3600)

    runner = Supervised("t", loop, running=lambda: True, on_crash=crashes.append, on_give_up=gave_up.append,
                        max_restarts=2, calm_s=60.0, clock=lambda: now[0])
    runner.start()
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(crashes) == 5 and not gave_up
    runner.cancel()
    await runner.wait()


@pytest.mark.asyncio
async def test_crashes_in_a_row_give_up():
    crashes, gave_up = [], []

    async def loop():
        raise RuntimeError("always")

    runner = Supervised("t", loop, running=lambda: True, on_crash=crashes.append, on_give_up=gave_up.append,
                        max_restarts=2, clock=lambda: 0.0)
    runner.start()
    await asyncio.wait_for(runner.wait(), 5)
    assert len(crashes) == 3 and len(gave_up) == 1
