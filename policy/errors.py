"""Deprecated import path, kept for one release: the error family lives in ``kvtier.errors``.

Importing this module raises ``KvtierDeprecationWarning``; ``kvtier.policy`` itself still re-exports
the error classes.
"""

from __future__ import annotations

import warnings

from kvtier.errors import (  # noqa: F401 - re-exported
    ClosedError,
    CorruptRecordError,
    DeviceError,
    ForkedProcessError,
    KvtierDeprecationWarning,
    KvtierError,
    KvtierWarning,
    TierFullError,
    TierIOError,
    TierTimeoutError,
    UnsafeDirectoryError,
)

__all__ = [
    "KvtierError",
    "KvtierWarning",
    "ClosedError",
    "TierIOError",
    "TierFullError",
    "TierTimeoutError",
    "CorruptRecordError",
    "DeviceError",
    "UnsafeDirectoryError",
    "ForkedProcessError",
]

warnings.warn(
    "kvtier.policy.errors is deprecated; import the error classes from kvtier.errors",
    KvtierDeprecationWarning,
    stacklevel=2,
)
