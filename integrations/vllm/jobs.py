"""A ``KvtierTier`` job's records and what a finished load counts: the job table's entries, the
completion the loop thread hands back, and the per-tier hit metrics vLLM exports.

Primitives: ``Job`` (a submitted store or load, as the job table keeps it; made and read on the
caller's thread), ``Done`` (one job's completion: made on kvtier's loop thread, put on the
completion queue, read on the caller's thread; frozen), ``metric_definitions`` (vLLM's Prometheus
metrics of the tier, per kvtier tier) and ``count_hits`` (a finished load's chunks, tokens, bytes
and time into those metrics and the tier's counters; the caller's thread, as it drains
completions). Importing this module imports vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, MutableMapping, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (OffloadingCounterMetadata, OffloadingHistogramMetadata, OffloadingMetricMetadata,
                                     OffloadKey)

__all__ = ["Job", "Done", "TIER_NAMES", "metric_definitions", "count_hits"]


@dataclass
class Job:
    kind: str  # "store" | "load"
    keys: List[OffloadKey]
    chunk_keys: List[bytes]
    # store: the chunk keys actually written (not already present); load: all of them
    written: List[bytes] = field(default_factory=list)
    submitted_s: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Done:
    job_id: int
    success: bool
    ok_chunk_keys: Optional[frozenset]  # loads: the keys whose record decoded and matched
    transfer_bytes: int
    transfer_s: float
    # loads: (kvtier tier, chunks, tokens, bytes) per tier that served keys; the deepest one
    by_tier: Tuple[Tuple[str, int, int, int], ...] = ()
    deepest_tier: Optional[str] = None


# The kvtier tiers a load can be served from, as metric labels: the LMDB disk, the fleet remote.
TIER_NAMES = ("disk", "remote")
TIER_LABEL_NAME = "kvtier_tier"
METRIC_HITS = "vllm:kvtier_tier_hits"
METRIC_HIT_TOKENS = "vllm:kvtier_tier_hit_tokens"
METRIC_HIT_BYTES = "vllm:kvtier_tier_hit_bytes"
METRIC_LOAD_SECONDS = "vllm:kvtier_tier_load_seconds"
_LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def metric_definitions() -> Dict[str, OffloadingMetricMetadata]:
    """vLLM's Prometheus metrics the tier reports through ``get_stats``, per kvtier tier."""
    labels = (TIER_LABEL_NAME,)
    return {
        METRIC_HITS: OffloadingCounterMetadata("Chunks kvtier restored, by the kvtier tier that held them.", labels),
        METRIC_HIT_TOKENS: OffloadingCounterMetadata("Tokens those chunks cover, by kvtier tier.", labels),
        METRIC_HIT_BYTES: OffloadingCounterMetadata("Primary-row bytes kvtier restored, by kvtier tier.", labels),
        METRIC_LOAD_SECONDS: OffloadingHistogramMetadata(
            "Duration of one kvtier load job, by the deepest kvtier tier it needed, in seconds.",
            labels, buckets=_LOAD_SECONDS_BUCKETS),
    }


def count_hits(done: Done, stats: OffloadingConnectorStats, tier_hits: MutableMapping[str, Any]) -> None:
    """Per kvtier tier: chunks, tokens and bytes a load restored; the job's time goes to the
    deepest tier it needed (a job that reached the remote waited for it)."""
    for name, chunks, tokens, nbytes in done.by_tier:
        label = (name,)
        for metric, value in ((METRIC_HITS, chunks), (METRIC_HIT_TOKENS, tokens), (METRIC_HIT_BYTES, nbytes)):
            stats.increase_counter(metric, value, label)
        tier_hits[f"{name}_hits"] += chunks
        tier_hits[f"{name}_hit_tokens"] += tokens
        tier_hits[f"{name}_hit_bytes"] += nbytes
    if done.deepest_tier is not None:
        stats.observe_histogram(METRIC_LOAD_SECONDS, done.transfer_s, (done.deepest_tier,))
        tier_hits[f"{done.deepest_tier}_load_s"] += done.transfer_s
