"""The engine's Prometheus metrics, in a registry of its own.

Primitives: ``EngineMetrics`` (intention-named recording methods, ``snapshot()`` of plain numbers,
``exposition()`` in the Prometheus text format) and the label vocabularies ``MISS_REASONS``,
``DROP_REASONS``. Every method is safe on any thread (prometheus_client metrics lock internally);
the engine calls the recording methods on the event-loop thread, an HTTP exporter may call
``exposition()`` on its own.

Each ``EngineMetrics`` owns a ``CollectorRegistry``, never the process-global default: two engines
in one process (tests, or a server with two models) would otherwise collide on metric names. To
serve it, hand ``metrics.registry`` to ``prometheus_client.start_http_server(port, registry=...)``
or ``make_asgi_app(registry=...)``.

Names (with the default ``namespace="kvtier"``):

=====================================  =========  ===================================================
``kvtier_lookups_total``               counter    lookup calls
``kvtier_hits_total``                  counter    lookups that found a hit (> 0 tokens)
``kvtier_hit_tokens_total``            counter    tokens those hits cover
``kvtier_misses_total{reason}``        counter    lookups or loads that found nothing usable
``kvtier_stored_chunks_total{tier}``   counter    chunks written into a tier (and ``_bytes_``)
``kvtier_loaded_chunks_total{tier}``   counter    chunks read from a tier (and ``_bytes_``): ``host``
                                                  (found on the host tier), ``disk`` (every chunk
                                                  the disk tier gave, a chain's too), ``remote``
                                                  (the part a chain's remote served), ``device``
``kvtier_dropped_chunks_total{reason}`` counter   stores given up, by reason
``kvtier_evictions_total{tier}``       counter    chunks evicted from a tier
``kvtier_latency_seconds{tier,op}``    histogram  duration of one tier operation (batch)
``kvtier_pressure_high``               gauge      1 while the pressure monitor pauses the engine
                                                  (read from the monitor when collected)
``kvtier_chunks{state}``               gauge      chunks per lifecycle state (pending, queued,
                                                  spilling, ready, loading, disk), read from a
                                                  callback when collected
``kvtier_worker_errors_total{where}``  counter    exceptions caught at a worker boundary (spill,
                                                  promote, store_copy, load_copy, refresh, loops)
``kvtier_events_dropped_total``        counter    chunk events dropped because nobody took them
=====================================  =========  ===================================================
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["EngineMetrics", "MISS_REASONS", "DROP_REASONS", "LATENCY_BUCKETS_S", "CONTENT_TYPE_LATEST"]

# Why a lookup or load found nothing usable. A closed vocabulary: an open one (exception text as a
# label) would grow a new time series per message.
MISS_REASONS: Tuple[str, ...] = (
    "missing",  # no chunk (or too few) under the key: the hit is 0
    "pending",  # a needed chunk is being written or loaded: lookup returns None, ask again
    "corrupt",  # a record failed its checksum or did not parse; it was quarantined
    "timeout",  # a tier did not answer within tier_timeout_s; the load was rolled back
    "tier_error",  # a tier raised (I/O error underneath)
    "copy_error",  # the device <-> host copy of a needed chunk failed
    "host_full",  # no host slot could be freed to promote a disk chunk into
    "cancelled",  # the caller cancelled the load
    "closed",  # the engine shut down during the load
    "starting",  # the engine is still making its host pools: the hit is 0
)
# Why a store was given up. Dropping is the engine's back-pressure: the caller never waits.
DROP_REASONS: Tuple[str, ...] = (
    "queue_full",  # store_queue_max_chunks reached
    "pressure",  # the pressure monitor says high
    "host_full",  # no host slot could be freed (all pinned or in flight)
    "copy_error",  # the device -> host copy failed
    "tier_error",  # the disk tier failed the write
    "evicted",  # a host chunk was evicted before it reached disk: its store is lost
    "pressure_prefetch",  # a prefetch (disk -> host promotion) refused under memory pressure
    "closed",  # the engine shut down with the store still queued
    "starting",  # the engine is still making its host pools: nothing can hold the chunks yet
)
# Drops count chunks whose store (or promotion) was given up; the names above are the only labels.
# From ~100 us (a host copy of a small chunk, one executor hop) to 30 s (tier_timeout_s's default).
LATENCY_BUCKETS_S: Tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# Tier and operation names are the engine's choice ("host", "disk", "lmdb"; "put", "get", "d2h"),
# but they must stay short identifiers so they cannot turn into unbounded label values.
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

StateCounts = Callable[[], Mapping[str, Union[int, float]]]
Number = Union[int, float]


class _ChunkStateCollector:
    """Collects ``<ns>_chunks{state}`` from a callback at scrape time, so the engine keeps plain
    counters and pays nothing per transition."""

    def __init__(self, name: str, callback: Optional[StateCounts]) -> None:
        self.name = name
        self.callback = callback

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, "Chunks per state.", labels=["state"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, "Chunks per state.", labels=["state"])
        for state, count in sorted(self.counts().items()):
            family.add_metric([state], count)
        yield family

    def counts(self) -> Dict[str, Number]:
        callback = self.callback
        if callback is None:
            return {}
        # The callback may run on an exporter's thread: it must return a copy (see EngineMetrics).
        return {str(state): count for state, count in dict(callback()).items()}


class _TierStatsCollector:
    """Collects ``<ns>_tier_stat{tier, stat}`` from the disk tier's flat statistics at scrape time
    (for a chained tier: ``remote.hits`` -> tier "remote", stat "hits"; the chain's own counters
    under tier "chain"), so per-tier hits, bytes, latencies, errors, evictions seen and breaker
    state reach Prometheus without a counter call on any hot path."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callback: Optional[Callable[[], Mapping[str, float]]] = None

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, "Disk tier statistics, per tier of a chain.", labels=["tier", "stat"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, "Disk tier statistics, per tier of a chain.", labels=["tier", "stat"])
        callback = self.callback
        if callback is not None:
            try:
                values = dict(callback())
            except Exception:  # a scrape must never break on a tier that is closing
                values = {}
            for key, value in sorted(values.items()):
                tier, _, stat = key.rpartition(".") if "." in key else ("disk", "", key)
                if isinstance(value, (int, float)):
                    family.add_metric([tier, stat], float(value))
        yield family


class EngineMetrics:
    """One engine's metrics: record with the methods below, read with ``snapshot()``.

    ``state_counts`` returns chunks per state (``{"READY": 12, ...}``); it is called whenever the
    registry is collected, possibly on an exporter thread, so it must be cheap and return a fresh
    mapping (e.g. ``dict(self._counts)``), never a view the event loop mutates meanwhile. It can be
    attached later with ``set_state_counts``.
    """

    def __init__(
        self,
        namespace: str = "kvtier",
        state_counts: Optional[StateCounts] = None,
        registry: Optional[CollectorRegistry] = None,
    ) -> None:
        if not re.match(r"^[a-zA-Z_][a-zA-Z0-9_]*$", namespace):
            raise ValueError(f"namespace must be a Prometheus name, got {namespace!r}")
        self.namespace = namespace
        self.registry = registry if registry is not None else CollectorRegistry()
        r, ns = self.registry, namespace
        self._lookups = Counter("lookups", "Lookup calls.", namespace=ns, registry=r)
        self._hits = Counter("hits", "Lookups that found a hit of more than 0 tokens.", namespace=ns, registry=r)
        self._hit_tokens = Counter("hit_tokens", "Tokens covered by hits.", namespace=ns, registry=r)
        self._misses = Counter(
            "misses", "Lookups or loads that found nothing usable, by reason.", ["reason"], namespace=ns, registry=r
        )
        self._stored_chunks = Counter(
            "stored_chunks", "Chunks written into a tier.", ["tier"], namespace=ns, registry=r
        )
        self._stored_bytes = Counter(
            "stored_bytes", "Raw bytes of chunks written into a tier.", ["tier"], namespace=ns, registry=r
        )
        self._loaded_chunks = Counter(
            "loaded_chunks", "Chunks read from a tier.", ["tier"], namespace=ns, registry=r
        )
        self._loaded_bytes = Counter(
            "loaded_bytes", "Raw bytes of chunks read from a tier.", ["tier"], namespace=ns, registry=r
        )
        self._dropped = Counter(
            "dropped_chunks", "Chunk stores given up, by reason.", ["reason"], namespace=ns, registry=r
        )
        self._evictions = Counter("evictions", "Chunks evicted from a tier.", ["tier"], namespace=ns, registry=r)
        self._latency = Histogram(
            "latency_seconds",
            "Duration of one tier operation (one batch), by tier and operation.",
            ["tier", "op"],
            namespace=ns,
            registry=r,
            buckets=LATENCY_BUCKETS_S,
        )
        self._pressure_high = Gauge(
            "pressure_high", "1 while memory pressure pauses prefetch and stores.", namespace=ns, registry=r
        )
        self._worker_errors = Counter(
            "worker_errors",
            "Exceptions caught at a worker boundary (the work failed, states stayed consistent).",
            ["where"],
            namespace=ns,
            registry=r,
        )
        self._events_dropped = Counter(
            "events_dropped", "Chunk events dropped from the bounded event log.", namespace=ns, registry=r
        )
        self._states = _ChunkStateCollector(f"{ns}_chunks", state_counts)
        r.register(self._states)
        self._tier_stats = _TierStatsCollector(f"{ns}_tier_stat")
        r.register(self._tier_stats)

        # Bound children, so the hot path skips labels()' argument handling and lock.
        self._children: Dict[Tuple[int, Tuple[str, ...]], object] = {}
        # Known reasons exist from the start at 0: a rate() over a series that appears only on its
        # first event misses that event.
        for reason in MISS_REASONS:
            self._child(self._misses, reason)
        for reason in DROP_REASONS:
            self._child(self._dropped, reason)

    # -- recording -----------------------------------------------------------------------------

    def lookup(self, n: int = 1) -> None:
        """Count ``n`` lookup calls (whatever their outcome)."""
        self._lookups.inc(n)

    def hit(self, tokens: int) -> None:
        """A lookup found a hit of ``tokens`` (> 0) tokens."""
        if tokens <= 0:
            raise ValueError(f"a hit covers at least one token, got tokens={tokens!r}; use miss('missing')")
        self._hits.inc()
        self._hit_tokens.inc(tokens)

    def miss(self, reason: str, n: int = 1) -> None:
        """A lookup or load found nothing usable; ``reason`` is one of ``MISS_REASONS``."""
        if reason not in MISS_REASONS:
            raise ValueError(f"miss reason must be one of {', '.join(MISS_REASONS)}, got {reason!r}")
        self._child(self._misses, reason).inc(n)

    def dropped(self, reason: str, n: int = 1) -> None:
        """``n`` chunk stores were given up; ``reason`` is one of ``DROP_REASONS``."""
        if reason not in DROP_REASONS:
            raise ValueError(f"drop reason must be one of {', '.join(DROP_REASONS)}, got {reason!r}")
        self._child(self._dropped, reason).inc(n)

    def stored(self, tier: str, chunks: int, nbytes: int) -> None:
        """``chunks`` chunks of ``nbytes`` raw bytes in all were written into ``tier``."""
        self._child(self._stored_chunks, tier).inc(chunks)
        self._child(self._stored_bytes, tier).inc(nbytes)

    def loaded(self, tier: str, chunks: int, nbytes: int) -> None:
        """``chunks`` chunks of ``nbytes`` raw bytes in all were read from ``tier``."""
        self._child(self._loaded_chunks, tier).inc(chunks)
        self._child(self._loaded_bytes, tier).inc(nbytes)

    def evicted(self, tier: str, n: int = 1) -> None:
        """``n`` chunks were evicted from ``tier``."""
        self._child(self._evictions, tier).inc(n)

    def latency(self, tier: str, op: str, seconds: float) -> None:
        """One ``op`` on ``tier`` (a batch, as the engine issues them) took ``seconds``."""
        self._child(self._latency, tier, op).observe(seconds)

    def pressure(self, paused: bool) -> None:
        """Record whether the pressure monitor currently pauses the engine."""
        self._pressure_high.set(1 if paused else 0)

    def watch_pressure(self, paused: Optional[Callable[[], bool]]) -> None:
        """Read ``kvtier_pressure_high`` from ``paused()`` whenever the registry is collected (or
        stop, with ``None``), so the gauge follows the monitor without the engine polling it."""
        if paused is None:
            self._pressure_high.set_function(lambda: float(self._pressure_high._value.get()))
            return
        self._pressure_high.set_function(lambda: 1.0 if paused() else 0.0)

    def worker_error(self, where: str, n: int = 1) -> None:
        """An exception was caught at the worker boundary ``where`` (a short identifier)."""
        self._child(self._worker_errors, where).inc(n)

    def events_dropped(self, n: int = 1) -> None:
        """``n`` chunk events fell off the bounded event log."""
        self._events_dropped.inc(n)

    def set_state_counts(self, state_counts: Optional[StateCounts]) -> None:
        """Attach (or detach, with ``None``) the chunks-per-state callback."""
        self._states.callback = state_counts

    def set_tier_statistics(self, callback: Optional[Callable[[], Mapping[str, float]]]) -> None:
        """Attach the disk tier's flat statistics (``TierStatistics.as_dict``), read at scrape
        time, possibly on an exporter thread: it must return a fresh mapping."""
        self._tier_stats.callback = callback

    def _child(self, metric, *labels: str):
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            for label in labels:
                if not isinstance(label, str) or not _NAME_RE.match(label):
                    raise ValueError(
                        f"tier/op label must be a short lowercase identifier ([a-z][a-z0-9_]*, at "
                        f"most 32 characters), got {label!r}"
                    )
            child = metric.labels(*labels)
            self._children[key] = child
        return child

    # -- reading -------------------------------------------------------------------------------

    def snapshot(self) -> Dict[str, object]:
        """Every metric as plain numbers: unlabelled ones as a number, labelled ones as
        ``{label: number}`` (latency as ``{"tier/op": number}`` for ``latency_count`` and
        ``latency_sum_s``), ``chunks`` as the state callback's counts."""
        snap: Dict[str, object] = {
            "lookups": _value(self._lookups),
            "hits": _value(self._hits),
            "hit_tokens": _value(self._hit_tokens),
            "misses": _by_label(self._misses, "reason"),
            "stored_chunks": _by_label(self._stored_chunks, "tier"),
            "stored_bytes": _by_label(self._stored_bytes, "tier"),
            "loaded_chunks": _by_label(self._loaded_chunks, "tier"),
            "loaded_bytes": _by_label(self._loaded_bytes, "tier"),
            "dropped": _by_label(self._dropped, "reason"),
            "evictions": _by_label(self._evictions, "tier"),
            "pressure_high": _value(self._pressure_high),
            "worker_errors": _by_label(self._worker_errors, "where"),
            "events_dropped": _value(self._events_dropped),
        }
        counts: Dict[str, Number] = {}
        sums: Dict[str, Number] = {}
        for family in self._latency.collect():
            for sample in family.samples:
                key = f"{sample.labels['tier']}/{sample.labels['op']}"
                if sample.name.endswith("_count"):
                    counts[key] = _plain(sample.value)
                elif sample.name.endswith("_sum"):
                    sums[key] = sample.value
        snap["latency_count"] = counts
        snap["latency_sum_s"] = sums
        snap["chunks"] = self._states.counts()
        return snap

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


def _plain(value: float) -> Number:
    # Counters are floats in prometheus_client; chunk and byte counts read better as ints.
    return int(value) if float(value).is_integer() else value


def _value(metric) -> Number:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") or sample.name == family.name:
                return _plain(sample.value)
    return 0


def _by_label(metric, label: str) -> Dict[str, Number]:
    values: Dict[str, Number] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                values[sample.labels[label]] = _plain(sample.value)
    return values
