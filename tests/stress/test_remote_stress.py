"""Stress (opt-in): a RemoteTier on a 3-primary cluster while nodes are stopped, resumed, killed
and restarted at random. ``python -m pytest tests/stress/test_remote_stress.py -s --iterations 200
--fault-seed N`` (the seed is printed). Invariants after every round: a hit returns exactly the bytes
that were put under its key (never anything else), a failed put leaves none of its keys on the
healthy primaries, no exception outside kvtier's error family escapes; at the end, once every node
is back, ``check()`` is clean and every key a put acknowledged since the last restart is readable.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from redis.crc import key_slot

from kvtier.errors import TierIOError
from kvtier.tiers.remote import RemoteTier
from kvtier.tools.testing.valkey import TEST_FINGERPRINT, make_items, read_back, restart_node

pytestmark = pytest.mark.stress


@pytest.mark.asyncio
async def test_remote_tier_under_random_node_faults(valkey_factory, iterations: int, fault_seed: int) -> None:
    rounds = max(1, iterations // 2)
    rng = random.Random(fault_seed)
    print(f"\nremote stress: {rounds} rounds, seed {fault_seed}")
    cluster = valkey_factory.cluster(3)
    tier = await RemoteTier.open(cluster.url, namespace="stress", fingerprint=TEST_FINGERPRINT, timeout_s=0.3,
                                 breaker_failures=1, breaker_reset_s=0.2, pipeline_max_bytes=128 << 10)
    acknowledged = {}
    stopped: set = set()
    failed_puts = 0
    kills = 0
    started = time.monotonic()
    try:
        for round_ in range(rounds):
            action = rng.random()
            victim = rng.randrange(3)
            if action < 0.1 and victim not in stopped:
                os.kill(cluster.nodes[victim].pid, signal.SIGSTOP)
                stopped.add(victim)
            elif action < 0.4 and stopped:
                v = stopped.pop()
                os.kill(cluster.nodes[v].pid, signal.SIGCONT)
            elif action < 0.45 and not stopped:
                os.kill(cluster.nodes[victim].pid, signal.SIGKILL)
                await asyncio.to_thread(restart_node, cluster, victim)
                kills += 1
                # The restarted primary came back empty: its keys are gone, the others' stay.
                for key in [k for k in acknowledged if cluster.node_for_slot(key_slot(tier.rkey(k))) is cluster.nodes[victim]]:
                    del acknowledged[key]
            items = make_items(rng.randrange(1, 12), rng.choice([1000, 50_000, 200_000]), seed=fault_seed * 100_000 + round_)
            try:
                await tier.put_many(items)
                for key, _, raw in items:
                    acknowledged[key] = bytes(raw)
            except TierIOError:
                failed_puts += 1
            sample = rng.sample(list(acknowledged.items()), min(8, len(acknowledged)))
            if sample:
                probe = [(k, None, memoryview(v)) for k, v in sample]
                metas, bufs = await read_back(tier, probe)
                for (key, want), meta, got in zip(sample, metas, bufs):
                    assert meta is None or bytes(got) == want, f"round {round_}: wrong bytes for {key.hex()}"
        for v in stopped:
            os.kill(cluster.nodes[v].pid, signal.SIGCONT)
        stopped.clear()
        await asyncio.sleep(0.5)
        for _ in range(40):
            if not await tier.check():
                break
            await asyncio.sleep(0.1)
        assert await tier.check() == []
        keys = list(acknowledged)
        probe = [(k, None, memoryview(acknowledged[k])) for k in keys]
        metas, bufs = await read_back(tier, probe)
        missing = sum(m is None for m in metas)
        assert all(m is None or bytes(b) == acknowledged[k] for k, m, b in zip(keys, metas, bufs))
        print(f"remote stress: {rounds} rounds in {time.monotonic() - started:.1f} s, {kills} kills, {failed_puts} puts failed "
              f"cleanly, {len(keys)} acknowledged keys read back, {missing} missing (evicted by a restart: 0 expected)")
        assert missing == 0
    finally:
        for v in stopped:
            os.kill(cluster.nodes[v].pid, signal.SIGCONT)
        await tier.close()
