"""The remote tier: kvtier's records in a Valkey/Redis server or cluster shared by a fleet.

Modules, one job each: ``url`` (``redis://`` / ``redis+cluster://`` addresses), ``breaker`` (the
per-node circuit breaker), ``router`` (slot map, one client per primary, bounded pipelines), ``notify`` (eviction
notifications from every primary),
``tier`` (``RemoteTier``, the ``ChunkTier`` facade: records, namespaces, evictions reported).
"""

from .tier import RemoteTier
from .url import RemoteAddress, parse_remote_url

__all__ = ["RemoteTier", "RemoteAddress", "parse_remote_url"]
