"""Loads counted per tier in the engine's Prometheus metrics: host, disk (the whole disk tier) and
the remote tier behind it, with two engines (two hosts, each its own LMDB) sharing a real Valkey."""

from __future__ import annotations

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT, OffloadScenario, make_cpu_device

PROMPT = list(range(1000, 1033))  # 33 tokens


def config(tmp_path, name, url, namespace):
    return EngineConfig(cache_dir=str(tmp_path / name), host_capacity_bytes=1 << 20, remote_url=url,
                        remote_namespace=namespace, remote_timeout_s=5.0)


@pytest.mark.asyncio
async def test_loads_are_counted_per_tier_host_disk_and_remote(tmp_path, valkey_node):
    layout = DEFAULT_TEST_LAYOUT
    namespace = f"tier-metrics-{tmp_path.name}"[:64]
    async with OffloadEngine(layout, make_cpu_device(layout), config(tmp_path, "a", valkey_node.url, namespace),
                             fingerprint=b"m") as host_a:
        producer = OffloadScenario(host_a)
        assert (await producer.produce(PROMPT)).durable
        await host_a.flush()
    async with OffloadEngine(layout, make_cpu_device(layout), config(tmp_path, "b", valkey_node.url, namespace),
                             fingerprint=b"m") as host_b:
        consumer = OffloadScenario(host_b)
        consumer.producer_bytes = producer.producer_bytes
        first = await consumer.consume(PROMPT + [7])  # from the remote (host B's LMDB is empty)
        loaded = sum(len(b) for b in first.loaded.values())
        stats = host_b.statistics()
        chunks = stats["loaded_chunks"]["device"]  # the chunks the hit needs (5: FA {0, 1}, SWA {5, 6, 7})
        assert chunks == 5 and stats["loaded_chunks"] == {"disk": chunks, "remote": chunks, "device": chunks}
        assert stats["loaded_bytes"]["remote"] == stats["loaded_bytes"]["disk"] > 0
        second = await consumer.consume(PROMPT + [8])  # now on host B's host tier
        assert sum(len(b) for b in second.loaded.values()) == loaded
        stats = host_b.statistics()
        assert stats["loaded_chunks"] == {"disk": chunks, "remote": chunks, "device": 2 * chunks, "host": chunks}
        assert stats["latency_count"]["remote/get"] == 1
        text = host_b.metrics.exposition().decode()
        assert f'kvtier_loaded_chunks_total{{tier="remote"}} {float(chunks)}' in text
        assert f'kvtier_loaded_chunks_total{{tier="host"}} {float(chunks)}' in text
