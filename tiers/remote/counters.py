"""The remote tier's counters and the ``TierStatistics`` made of them: ``RemoteCounters``.

Event-loop thread only: every part of the tier that counts (the tier's request paths, ``Fanout``,
``Listing``) runs there, so the counters need no lock.
"""

from __future__ import annotations

import time
from typing import Dict

from ..base import TierStatistics
from .keyspace import Keyspace
from .notify import EvictionListener
from .router import NodeRouter

__all__ = ["RemoteCounters"]


class RemoteCounters:
    """``stats``: the ``TierStatistics`` fields (items, not batches, unless named so); ``extra``:
    the tier-specific ones (``RemoteTier.statistics`` lists them). Event-loop thread only."""

    def __init__(self) -> None:
        self.stats: Dict[str, int] = dict(
            puts=0, put_batches=0, gets=0, hits=0, misses=0, corrupt=0, mismatched=0,
            quarantined=0, evictions=0, deletes=0, errors=0,
        )
        self.extra: Dict[str, float] = dict(
            put_bytes=0, get_bytes=0, put_seconds=0.0, get_seconds=0.0, put_seconds_max=0.0,
            get_seconds_max=0.0, get_batches=0, timeouts=0, full=0, breaker_rejected=0,
            evictions_notified=0, arrivals_notified=0, arrivals_listed=0, touches=0, touches_skipped=0,
            removals_listed=0, listings=0,
            rollbacks=0, moved=0, get_direct=0,
        )

    def batch_done(self, kind: str, nbytes: int, started: float) -> None:
        """A ``kind`` (``put`` or ``get``) batch that began at ``started`` (``perf_counter``) moved
        ``nbytes``: its bytes, its latency into the total and the maximum."""
        elapsed = time.perf_counter() - started
        extra = self.extra
        extra[f"{kind}_bytes"] += nbytes
        extra[f"{kind}_seconds"] += elapsed
        extra[f"{kind}_seconds_max"] = max(extra[f"{kind}_seconds_max"], elapsed)

    def statistics(self, keys: Keyspace, router: NodeRouter, listener: EvictionListener,
                   degraded: bool) -> TierStatistics:
        """The counters with what the parts know now: known keys and bytes, nodes, breakers,
        notification listeners, the sequence."""
        extra = dict(self.extra)
        primaries = router.primaries()
        extra["nodes"] = float(len(primaries))
        extra["breaker_open"] = float(sum(1 for n in primaries if n.breaker.state != "closed"))
        extra["breaker_opens"] = float(sum(n.breaker.opens for n in router.nodes.values()))
        extra["notifications_on"] = float(sum(1 for v in listener.enabled.values() if v))
        extra["listener_restarts"] = float(listener.restarts)
        extra["sequence"] = float(keys.sequence)
        s = self.stats
        return TierStatistics(
            records=len(keys.known), bytes=keys.known_bytes, capacity_bytes=None,
            puts=s["puts"], put_batches=s["put_batches"], gets=s["gets"], hits=s["hits"],
            misses=s["misses"], corrupt=s["corrupt"], mismatched=s["mismatched"],
            quarantined=s["quarantined"], evictions=s["evictions"], deletes=s["deletes"],
            errors=s["errors"], degraded=degraded, extra=extra,
        )
