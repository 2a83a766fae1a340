"""kvtier's own exception and warning family.

It lives in the bottom layer so that every layer (policy, tiers, engine, tools) raises and catches
the same classes without importing upward. Bad arguments at construction stay builtin
``ValueError``/``TypeError``; these classes are for kvtier's own failures, split by cause:

- ``ClosedError``: the object was closed by us (engine or tier shut down).
- ``TierIOError``: something underneath broke (disk, LMDB, filesystem); the original is ``__cause__``.
- ``TierFullError``: no space (disk full, capacity reached, map cannot grow).
- ``CorruptRecordError``: bytes that do not parse or fail their checksum; never returned as data.
- ``DeviceError``: wrong-shaped tensors, bad block ids, a missing GPU.
- ``UnsafeDirectoryError``: a cache directory that others could write or that we do not own.
- ``ForkedProcessError``: a forked child touched an environment its parent opened.
"""

from __future__ import annotations

__all__ = [
    "KvtierError",
    "KvtierWarning",
    "ClosedError",
    "TierIOError",
    "TierFullError",
    "CorruptRecordError",
    "DeviceError",
    "UnsafeDirectoryError",
    "ForkedProcessError",
    "TierTimeoutError",
]


class KvtierError(Exception):
    """Base class of every error kvtier raises for its own failures."""


class KvtierWarning(UserWarning):
    """Base class of kvtier's warnings (the test suite turns them into errors)."""


class ClosedError(KvtierError):
    """The engine or tier was closed (by its owner) before or during the call."""


class TierIOError(KvtierError):
    """An I/O or database error underneath a tier; the original exception is ``__cause__``."""


class TierFullError(TierIOError):
    """The tier has no room: the disk is full or the configured capacity cannot be freed."""


class TierTimeoutError(TierIOError):
    """A tier did not answer within the configured time; the operation was rolled back."""


class CorruptRecordError(KvtierError):
    """A record is malformed or fails its checksum. Its bytes are never returned."""


class DeviceError(KvtierError):
    """A device-side request cannot be carried out: wrong shape or dtype, bad block id, no GPU."""


class UnsafeDirectoryError(KvtierError):
    """A cache directory is world-writable or not owned by this user; kvtier refuses to use it."""


class ForkedProcessError(KvtierError):
    """A forked child used an environment opened by its parent (LMDB forbids it)."""
