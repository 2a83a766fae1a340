"""The engine's one hook for the remote tier: wrap the disk tier it opened into host -> LMDB ->
remote when ``EngineConfig.remote_url`` is set. Runs on the event loop at ``start``.

Kept out of ``engine.py`` so the engine stays unaware of chaining: it gets one ``ChunkTier`` as its
disk tier either way (``tiers/chain.py`` does the chaining, ``tiers/remote`` the remote).
"""

from __future__ import annotations

import logging
from typing import Optional

from kvtier.tiers.base import ChunkTier

from .config import EngineConfig

__all__ = ["attach_remote_tier"]

logger = logging.getLogger("kvtier.engine")


async def attach_remote_tier(disk: Optional[ChunkTier], config: EngineConfig, fingerprint: bytes) -> Optional[ChunkTier]:
    """``disk`` unchanged when no ``remote_url`` is set; else a ``ChainedTier`` of ``disk`` and a
    ``RemoteTier`` (or the ``RemoteTier`` alone when there is no disk tier). A remote that cannot be
    reached at start does not stop the engine: it starts degraded (a warning is logged, the tier's
    ``degraded`` and ``breaker_open`` say so) and heals when the server answers again - a remote is
    a cache, never worse than recomputing.

    Cancelling it: the remote tier is not opened; ``disk`` is closed."""
    if config.remote_url is None:
        return disk
    if config.disk_index_refresh_interval_s is None:
        logger.warning("remote tier without disk_index_refresh_interval_s: chunks other hosts write become "
                       "hits here only after a restart (set it, e.g. 10 s)")
    from kvtier.tiers.chain import ChainedTier
    from kvtier.tiers.remote import RemoteTier

    try:
        remote = await RemoteTier.open(
            config.remote_url,
            namespace=config.remote_namespace,
            fingerprint=fingerprint,
            codec=config.codec_config(),
            timeout_s=config.remote_timeout_s,
            connect_timeout_s=config.remote_connect_timeout_s,
            concurrency=config.remote_concurrency,
            pipeline_max_bytes=config.remote_pipeline_max_bytes,
            breaker_failures=config.remote_breaker_failures,
            breaker_reset_s=config.remote_breaker_reset_s,
            listing_interval_s=config.remote_listing_interval_s,
            require_connection=False,
        )
    except BaseException:
        if disk is not None:
            await disk.close()
        raise
    if disk is None:
        return remote
    return ChainedTier([disk, remote], write_policy=config.remote_write_policy, promote=config.remote_promote_to_disk)
