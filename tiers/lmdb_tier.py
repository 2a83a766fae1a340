"""Deprecated import path, kept for one release: the LMDB tier is the package ``kvtier.tiers.lmdb``.

Importing this module raises ``KvtierDeprecationWarning``.
"""

from __future__ import annotations

import warnings

from kvtier.errors import CorruptCacheError, KvtierDeprecationWarning

from .lmdb import LmdbTier, RecordInfo, VerifyReport, quarantine_cache_dir

__all__ = ["LmdbTier", "RecordInfo", "VerifyReport", "CorruptCacheError", "quarantine_cache_dir"]

warnings.warn(
    "kvtier.tiers.lmdb_tier is deprecated; import from kvtier.tiers.lmdb",
    KvtierDeprecationWarning,
    stacklevel=2,
)
