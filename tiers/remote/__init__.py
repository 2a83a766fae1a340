"""The remote tier: kvtier's records in a Valkey/Redis server or cluster shared by a fleet.

Modules, one job each: ``url`` (``redis://`` / ``redis+cluster://`` addresses), ``breaker`` (the
per-node circuit breaker), ``router`` (slot map, one client per primary, bounded pipelines),
``fanout`` (one command per key over the owning nodes, size-capped pipelines), ``getreader``
(``GET`` replies read straight into the caller's buffers), ``keyspace`` (server-side names, known
keys, sequence, removal reports), ``notify`` (eviction notifications from every primary),
``listing`` (``SCAN`` and the backstop listing), ``coding`` (the record codec on the tier's own
threads), ``counters`` (counters and statistics), ``tier`` (``RemoteTier``, the ``ChunkTier``
facade that wires them: puts all or nothing, gets, deletes, health, close).
"""

from .tier import RemoteTier
from .url import RemoteAddress, parse_remote_url

__all__ = ["RemoteTier", "RemoteAddress", "parse_remote_url"]
