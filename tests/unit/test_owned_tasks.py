"""The one wait-through-cancel helper and the owned task set (tiers/owned_tasks.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.tiers.owned_tasks import OwnedTasks, settle, wait_through_cancel


@pytest.mark.asyncio
async def test_a_cancel_in_the_turn_the_work_ends_is_not_lost():
    loop = asyncio.get_running_loop()
    work = loop.create_future()
    waiter = asyncio.ensure_future(wait_through_cancel(work))
    await asyncio.sleep(0)
    work.set_result(1)
    waiter.cancel()  # the same loop turn: the waiter must still learn it was cancelled
    assert await waiter is True
    work2 = loop.create_future()
    settling = asyncio.ensure_future(settle(work2))
    await asyncio.sleep(0)
    work2.set_result(2)
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling


@pytest.mark.asyncio
async def test_cancelled_again_and_again_it_waits_for_the_end_and_leaves_the_outcome():
    release = asyncio.Event()

    async def work():
        await release.wait()
        raise ValueError("the work's own failure")

    task = asyncio.ensure_future(work())
    waiter = asyncio.ensure_future(wait_through_cancel(task))
    for _ in range(3):
        await asyncio.sleep(0)
        waiter.cancel()
    await asyncio.sleep(0.01)
    assert not waiter.done() and not task.done()
    release.set()
    assert await waiter is True
    with pytest.raises(ValueError, match="the work's own failure"):  # still there for its owner
        await task


@pytest.mark.asyncio
async def test_owned_tasks_report_failures_and_wait_all_survives_a_cancel():
    failures = []
    owned = OwnedTasks(on_error=failures.append)
    release = asyncio.Event()

    async def fails():
        await release.wait()
        raise RuntimeError("boom")

    task = owned.spawn(fails())
    waiter = asyncio.ensure_future(owned.wait_all())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not task.done() and len(owned) == 1
    release.set()
    await owned.wait_all()
    assert [str(e) for e in failures] == ["boom"] and len(owned) == 0
