"""kvtier's own exception and warning family: the bottom layer, importing nothing of kvtier.

Every layer (policy, tiers, engine, tools) raises and catches these classes, so they live below all
of them (``kvtier.errors``; a test checks that this package imports nothing else of kvtier). Bad
arguments stay builtin ``ValueError`` / ``TypeError``; these classes are kvtier's own failures, split
by cause:

- ``ClosedError``: the object was closed by its owner (engine or tier shut down).
- ``TierIOError``: something underneath broke (disk, LMDB, filesystem, network); the original
  exception is ``__cause__``. Subclasses: ``TierFullError`` (no room), ``TierTimeoutError`` (the
  remote tier did not answer in time), ``CorruptCacheError`` (a whole LMDB environment is damaged).
- ``CorruptRecordError``: bytes that do not parse or fail their checksum; never returned as data.
  Subclasses name the way a record failed (``RecordFormatError``, ``RecordChecksumError``,
  ``RecordMetaMismatchError``, ``RecordSizeMismatchError``).
- ``DeviceError``: wrong-shaped tensors, bad block ids, a missing GPU.
- ``UnsafeDirectoryError``: a cache directory that others could write or that we do not own.
- ``ForkedProcessError``: a forked child touched an environment its parent opened.
- ``SlotStateError``: a host slot used against its state (a bug in the caller's bookkeeping).
- ``EngineInvariantError``: ``OffloadEngine.check`` found its tables disagreeing.
- ``EngineUsageError``: the engine was called from another event loop or thread than its own, or
  after a background loop of it failed for good (a forked child gets ``ForkedProcessError``).
- ``InjectedFault``: a fault the test harness scripted (``kvtier.tools.testing.faults``); a ``TierIOError``
  so it travels the same paths as a real one.

Warnings: ``KvtierWarning`` is the base (the test suite turns it into an error);
``KvtierDeprecationWarning`` is raised on import of a module kept only as an old import path.
"""

from __future__ import annotations

__all__ = [
    "KvtierError",
    "KvtierWarning",
    "KvtierDeprecationWarning",
    "ClosedError",
    "TierIOError",
    "TierFullError",
    "TierTimeoutError",
    "CorruptCacheError",
    "CorruptRecordError",
    "RecordFormatError",
    "RecordChecksumError",
    "RecordMetaMismatchError",
    "RecordSizeMismatchError",
    "DeviceError",
    "UnsafeDirectoryError",
    "ForkedProcessError",
    "SlotStateError",
    "EngineInvariantError",
    "EngineUsageError",
    "InjectedFault",
]


class KvtierError(Exception):
    """Base class of every error kvtier raises for its own failures."""


class KvtierWarning(UserWarning):
    """Base class of kvtier's warnings (the test suite turns them into errors)."""


class KvtierDeprecationWarning(KvtierWarning, DeprecationWarning):
    """An old import path, kept for one release; the message names the new one."""


class ClosedError(KvtierError):
    """The engine or tier was closed (by its owner) before or during the call."""


class TierIOError(KvtierError):
    """An I/O or database error underneath a tier; the original exception is ``__cause__``."""


class TierFullError(TierIOError):
    """The tier has no room: the disk is full or the configured capacity cannot be freed."""


class TierTimeoutError(TierIOError):
    """A tier did not answer within its configured time (raised by the remote tier). What the
    operation did on the far side is unknown: a put may or may not have landed, so the engine
    treats the keys as absent."""


class CorruptCacheError(TierIOError):
    """The cache directory's LMDB environment is damaged (not an LMDB file, truncated, pages that do
    not parse). Nothing in it can be trusted; ``kvtier.tiers.lmdb.quarantine_cache_dir`` moves it
    aside."""


class CorruptRecordError(KvtierError):
    """A record is malformed or fails its checksum. Its bytes are never returned."""


class RecordFormatError(CorruptRecordError):
    """The record does not parse: magic, version, codec, lengths or a header field is wrong."""


class RecordChecksumError(CorruptRecordError):
    """The record parses but its checksum does not match key + header + payload."""


class RecordMetaMismatchError(CorruptRecordError):
    """The record is intact but describes another chunk than the caller expected."""


class RecordSizeMismatchError(CorruptRecordError):
    """The record is intact but its raw length differs from the caller's buffer."""


class DeviceError(KvtierError):
    """A device-side request cannot be carried out: wrong shape or dtype, bad block id, no GPU."""


class UnsafeDirectoryError(KvtierError):
    """A cache directory is world-writable or not owned by this user; kvtier refuses to use it."""


class ForkedProcessError(KvtierError):
    """A forked child used an environment opened by its parent (LMDB forbids it)."""


class SlotStateError(KvtierError, RuntimeError):
    """A slot was used against its state: released or viewed while free, released while pinned,
    unpinned more often than pinned. Always a bug in the caller's bookkeeping."""


class EngineInvariantError(KvtierError):
    """``OffloadEngine.check`` found the engine's tables disagreeing with each other."""


class EngineUsageError(KvtierError, RuntimeError):
    """The engine was called where it cannot work: from another event loop or thread than the one
    that started it, or after one of its background loops failed for good."""


class InjectedFault(TierIOError):
    """Raised by ``kvtier.tools.testing.faults.FaultyTier`` where a fault was scripted; a ``TierIOError``
    like a real one."""
