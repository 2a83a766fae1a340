"""EngineMetrics: exact counts, per-engine registries, exposition."""

from __future__ import annotations

import prometheus_client
import pytest

from kvtier.engine.metrics import DROP_REASONS, MISS_REASONS, EngineMetrics


def test_fresh_snapshot_is_all_zero_with_known_reasons_present():
    snap = EngineMetrics().snapshot()
    assert snap["lookups"] == 0 and snap["hits"] == 0 and snap["hit_tokens"] == 0
    assert snap["misses"] == {reason: 0 for reason in MISS_REASONS}
    assert snap["dropped"] == {reason: 0 for reason in DROP_REASONS}
    assert snap["stored_chunks"] == {} and snap["latency_count"] == {} and snap["chunks"] == {}
    assert snap["pressure_high"] == 0


def test_counters_move_exactly():
    metrics = EngineMetrics()
    for _ in range(5):
        metrics.lookup()
    metrics.lookup(3)
    metrics.hit(32)
    metrics.hit(64)
    metrics.miss("missing")
    metrics.miss("pending", n=2)
    metrics.miss("corrupt")
    metrics.miss("timeout")
    metrics.dropped("queue_full")
    metrics.dropped("pressure", n=4)
    metrics.dropped("host_full", 2)
    metrics.dropped("tier_error")
    metrics.stored("host", 3, 3 * 4096)
    metrics.stored("host", 1, 4096)
    metrics.stored("disk", 2, 8192)
    metrics.loaded("disk", 1, 4096)
    metrics.loaded("host", 5, 5 * 4096)
    metrics.evicted("host", 2)
    metrics.evicted("disk")
    metrics.latency("disk", "put", 0.25)
    metrics.latency("disk", "put", 0.5)
    metrics.latency("host", "d2h", 0.001)
    metrics.pressure(True)

    snap = metrics.snapshot()
    assert snap["lookups"] == 8
    assert snap["hits"] == 2 and snap["hit_tokens"] == 96
    assert snap["misses"] == {
        "missing": 1, "pending": 2, "corrupt": 1, "timeout": 1, "tier_error": 0, "copy_error": 0,
        "host_full": 0, "cancelled": 0, "closed": 0, "starting": 0,
    }  # fmt: skip
    assert snap["dropped"] == {
        "queue_full": 1, "pressure": 4, "host_full": 2, "copy_error": 0, "tier_error": 1, "evicted": 0,
        "pressure_prefetch": 0, "closed": 0, "starting": 0,
    }  # fmt: skip
    assert snap["stored_chunks"] == {"host": 4, "disk": 2}
    assert snap["stored_bytes"] == {"host": 16384, "disk": 8192}
    assert snap["loaded_chunks"] == {"disk": 1, "host": 5}
    assert snap["loaded_bytes"] == {"disk": 4096, "host": 20480}
    assert snap["evictions"] == {"host": 2, "disk": 1}
    assert snap["latency_count"] == {"disk/put": 2, "host/d2h": 1}
    assert snap["latency_sum_s"] == {"disk/put": 0.75, "host/d2h": 0.001}
    assert snap["pressure_high"] == 1
    assert all(isinstance(v, int) for v in snap["stored_bytes"].values())  # plain numbers

    metrics.pressure(False)
    assert metrics.snapshot()["pressure_high"] == 0


def test_chunk_state_gauge_reads_the_callback_at_collection():
    counts = {"READY": 3, "PENDING": 1}
    metrics = EngineMetrics(state_counts=lambda: dict(counts))
    assert metrics.snapshot()["chunks"] == {"READY": 3, "PENDING": 1}
    counts["READY"] = 7
    text = metrics.exposition().decode()
    assert 'kvtier_chunks{state="READY"} 7.0' in text
    assert 'kvtier_chunks{state="PENDING"} 1.0' in text
    metrics.set_state_counts(None)
    assert metrics.snapshot()["chunks"] == {}


def test_two_engines_in_one_process_are_independent_and_off_the_global_registry():
    first, second = EngineMetrics(), EngineMetrics()
    assert first.registry is not second.registry
    first.lookup(2)
    first.stored("host", 1, 100)
    second.miss("missing")
    assert first.snapshot()["lookups"] == 2 and second.snapshot()["lookups"] == 0
    assert second.snapshot()["stored_chunks"] == {}
    assert first.snapshot()["misses"]["missing"] == 0
    assert prometheus_client.REGISTRY.get_sample_value("kvtier_lookups_total") is None


def test_exposition_contains_metric_names():
    metrics = EngineMetrics(state_counts=lambda: {"READY": 1})
    metrics.lookup()
    metrics.hit(16)
    metrics.stored("host", 1, 10)
    metrics.loaded("disk", 1, 10)
    metrics.evicted("host")
    metrics.latency("disk", "get", 0.01)
    text = metrics.exposition().decode()
    for name in (
        "kvtier_lookups_total 1.0",
        "kvtier_hits_total 1.0",
        "kvtier_hit_tokens_total 16.0",
        'kvtier_misses_total{reason="missing"} 0.0',
        'kvtier_stored_chunks_total{tier="host"} 1.0',
        'kvtier_stored_bytes_total{tier="host"} 10.0',
        'kvtier_loaded_chunks_total{tier="disk"} 1.0',
        'kvtier_loaded_bytes_total{tier="disk"} 10.0',
        'kvtier_dropped_chunks_total{reason="queue_full"} 0.0',
        'kvtier_evictions_total{tier="host"} 1.0',
        'kvtier_latency_seconds_count{op="get",tier="disk"} 1.0',
        'kvtier_latency_seconds_bucket{le="0.01",op="get",tier="disk"} 1.0',
        "kvtier_pressure_high 0.0",
        'kvtier_chunks{state="READY"} 1.0',
    ):
        assert name in text, name


def test_namespace_prefixes_every_name():
    metrics = EngineMetrics(namespace="kvtier_model_b")
    metrics.lookup()
    assert "kvtier_model_b_lookups_total 1.0" in metrics.exposition().decode()
    with pytest.raises(ValueError, match=r"namespace must be a Prometheus name, got 'a-b'"):
        EngineMetrics(namespace="a-b")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.miss("oops"), r"miss reason must be one of missing, .*, got 'oops'"),
        (lambda m: m.dropped("full"), r"drop reason must be one of queue_full, .*, got 'full'"),
        (lambda m: m.hit(0), r"a hit covers at least one token, got tokens=0"),
        (lambda m: m.stored("Host Tier", 1, 1), r"short lowercase identifier .* got 'Host Tier'"),
        (lambda m: m.latency("disk", "x" * 40, 1.0), r"short lowercase identifier"),
        (lambda m: m.stored("host", -1, 0), r"negative"),
    ],
)
def test_bad_labels_and_values_are_value_errors(call, match):
    metrics = EngineMetrics()
    with pytest.raises(ValueError, match=match):
        call(metrics)
