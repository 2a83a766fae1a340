"""The vLLM tier's store settings and its loop thread, without a scheduler (vLLM is imported)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import threading

# Before vLLM is first imported in this process (it infers its device once): a test file that
# runs after this one in the same worker builds vLLM objects on CPU.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from kvtier.engine.config import EngineConfig
from kvtier.integrations.vllm.config import VllmTierConfig
from kvtier.integrations.vllm.loop import LoopThread
from kvtier.integrations.vllm.records import codec_for


def test_a_tier_dict_gives_the_engines_store_settings():
    """Keys left out mean what they mean for an OffloadEngine: the safety switches are on for
    both because both read StoreConfig's defaults; only the remote namespace differs, on purpose."""
    tier = VllmTierConfig(cache_dir="/nvme/kv").store_config()
    assert tier == dataclasses.replace(EngineConfig(cache_dir="/nvme/kv").store, remote_namespace="vllm")
    assert tier.lmdb_verify_on_open is True and tier.quarantine_corrupt_cache_dir is True
    given = VllmTierConfig(cache_dir="/nvme/kv", disk_capacity_bytes=1 << 30, compression=0, read_workers=2,
                           lmdb_verify_on_open=False, eviction_policy="lfuda", remote_url="redis://h:6379",
                           remote_namespace="fleet")
    engine = EngineConfig(cache_dir="/nvme/kv", disk_capacity_bytes=1 << 30, compression_enabled=False,
                          read_workers=2, lmdb_verify_on_open=False, eviction_policy="lfuda",
                          remote_url="redis://h:6379", remote_namespace="fleet")
    assert given.store_config() == engine.store
    assert given.store_config(read_only=True).read_only is True
    assert codec_for(0) == engine.codec_config() and codec_for(5) == EngineConfig(compression_level=5).codec_config()


def test_posted_tasks_are_owned_until_they_end():
    """asyncio keeps only a weak reference to a task: one waiting on a future nobody else holds is
    collected mid-flight unless the loop thread keeps it."""
    loop = LoopThread(name="kvtier-test-loop")
    started, closed = threading.Event(), threading.Event()

    async def waits_forever():
        started.set()
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            closed.set()

    async def collect():
        gc.collect()

    try:
        loop.post(waits_forever)
        assert started.wait(5)
        loop.run(collect(), 5)
        assert not closed.is_set(), "the posted task was collected while it waited"
        loop.call(lambda: [t.cancel() for t in asyncio.all_tasks(loop.loop)])
        loop.run(loop.idle(), 5)
        assert closed.is_set()
    finally:
        loop.stop(5)


def test_idle_waits_for_posted_tasks_and_a_failure_is_logged(caplog):
    loop = LoopThread(name="kvtier-test-loop")
    done = []

    async def work():
        await asyncio.sleep(0.05)
        done.append(1)

    async def broken():
        raise RuntimeError("escaped the task")

    try:
        loop.post(work)
        loop.post(broken)
        loop.run(asyncio.sleep(0), 5)  # the posts ran: both tasks exist
        loop.run(loop.idle(), 5)
        assert done == [1]
        assert any("escaped the task" in r.getMessage() for r in caplog.records)
    finally:
        loop.stop(5)
