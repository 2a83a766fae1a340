"""The LMDB environment one tier opens, the lock around remapping it, and the tier's counters.

Primitives:

- ``Counters``: the tier's counter table (any thread; one lock).
- ``claim_directory`` / ``release_directory``: one open tier per directory in a process (two would
  each take the other's locks); any thread.
- ``LmdbEnv``: the ``lmdb.Environment`` of one cache directory with its tables, opened safely
  (``open``: the lock file allocated first, the data file and the tables checked, LMDB errors said
  as kvtier's), and the shared/exclusive map lock that every transaction holds shared and every
  remap (a growth, adopting another process's growth, a reopen after ``MDB_PANIC``) exclusive.
  ``read_txn`` runs a read transaction on any thread but the writer; ``reopen`` only on the writer
  thread. ``io_hook`` (a ``tiers.base.IOHook``) is called before every put, commit and read
  transaction of the tier: the fault suite replaces it.
"""

from __future__ import annotations

import heapq
import logging
import operator
import os
import threading
from pathlib import Path
from typing import Callable, Dict, Iterable, Tuple, TypeVar

import lmdb

from kvtier.errors import CorruptCacheError, TierFullError, TierIOError

from ..base import NO_IO_HOOK, IOHook
from ..lru import ByteLru, make_byte_index
from ..writer import SharedExclusiveLock
from .opening import is_disk_full, lock_for_readonly, open_kvtier_tables, prepare_lock_file
from .recovery import CORRUPT_LMDB_ERRORS, check_data_file, stamp_verified, verify_structure_at_rest
from .segment_files import reclaim_orphans
from .segments import committed_ends
from .tables import Tables, index_entries, read_sequence

__all__ = ["Counters", "LmdbEnv", "claim_directory", "release_directory"]

# Entries sorted at once while building the eviction index (~10 ms of the GIL each).
_SORT_PIECE = 16384

log = logging.getLogger(__name__)

T = TypeVar("T")

# Directories this process has open, keyed by (st_dev, st_ino); the pid guards against a fork
# inheriting the parent's entries.
_OPEN_DIRS: Dict[Tuple[int, int], int] = {}
_OPEN_DIRS_LOCK = threading.Lock()


def claim_directory(path: Path) -> Tuple[int, int]:
    """Mark ``path`` open in this process (``ValueError`` when it already is); returns its id for
    ``release_directory``."""
    st = os.stat(path)
    dir_id = (st.st_dev, st.st_ino)
    with _OPEN_DIRS_LOCK:
        if _OPEN_DIRS.get(dir_id) == os.getpid():
            raise ValueError(f"{path} is already open in this process; share that LmdbTier")
        _OPEN_DIRS[dir_id] = os.getpid()
    return dir_id


def release_directory(dir_id: Tuple[int, int]) -> None:
    """Undo this process's ``claim_directory`` (not a parent's entry a fork inherited)."""
    with _OPEN_DIRS_LOCK:
        if _OPEN_DIRS.get(dir_id) == os.getpid():
            del _OPEN_DIRS[dir_id]


class Counters:
    """A tier's counters by name (any thread)."""

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._values: Dict[str, int] = dict.fromkeys(names, 0)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._values)


class LmdbEnv:
    """One cache directory's LMDB environment and tables (see the module docstring). Any thread:
    ``read_txn`` on any but the writer, ``reopen`` on the writer only, ``open`` on the opening one.

    ``pointers``: the tier may write segment pointers (``tables.open_tables``); ``verify_structure``:
    check the whole file with py-lmdb's offline verifier before the first open maps it."""

    def __init__(self, path: Path, counters: Counters, *, readonly: bool, verify_structure: bool, pointers: bool) -> None:
        self.path = path
        self.readonly = readonly
        self.counters = counters
        self.map_lock = SharedExclusiveLock()
        self.io_hook: IOHook = NO_IO_HOOK
        # True when read-only without LMDB's lock file: every value is copied before it is checked.
        self.lockless = False
        self._verify_structure = verify_structure
        self._pointers = pointers
        self._opened = False
        # Verified at open (or unchanged since a verified clean close): a clean close stamps it.
        self._sound_at_open = False
        self.env: lmdb.Environment
        self.tables: Tables
        # The map size statistics() last read (it never waits behind a remap for a new one).
        self.map_size_read = 0.0

    def open(self, map_size_bytes: int) -> None:
        """Open the environment and its tables (opening thread, or the writer under the exclusive
        map lock for a reopen). ``CorruptCacheError`` / ``TierFullError`` / ``TierIOError``."""
        check_data_file(self.path)
        # The lock file is allocated before LMDB maps it, so a full disk is TierFullError instead
        # of SIGBUS. A read-only open uses it too (creating it if it can): reads outside LMDB's
        # reader table let a writer reuse their pages mid-read. Where it cannot, every read copies
        # the record out of the map before checking it (``lockless``).
        if self.readonly:
            use_lock = lock_for_readonly(self.path)
            if not use_lock:
                log.info("kvtier lmdb: %s: cannot use or create lock.mdb (a read-only mount, no permission "
                         "or no space): reading without LMDB's lock, each record copied, then checked", self.path)
        else:
            prepare_lock_file(self.path)
            use_lock = True
        self.lockless = not use_lock
        if self._verify_structure and not self._opened:  # not on a reopen after MDB_PANIC
            self._sound_at_open = verify_structure_at_rest(self.path, create_lock=not self.readonly)
        try:
            env = lmdb.open(
                str(self.path),
                subdir=True,
                map_size=map_size_bytes,
                max_dbs=5,
                # Both fsyncs on every commit: DESIGN promises that a put whose wait_durable() said
                # True survives a power cut, and with metasync=False the last commit's meta page
                # may not be on disk yet (LMDB then opens at the transaction before).
                sync=True,
                metasync=True,
                writemap=False,
                readahead=True,
                readonly=self.readonly,
                create=not self.readonly,
                mode=0o600,
                lock=use_lock,
            )
        except CORRUPT_LMDB_ERRORS as exc:
            raise CorruptCacheError(f"cannot open LMDB environment at {self.path}: {exc}") from exc
        except lmdb.Error as exc:
            raise _said(exc, f"no space left to open the LMDB environment at {self.path}",
                        f"cannot open LMDB environment at {self.path}") from exc
        try:
            # compaction moves pointers too, but only in a cache that already holds them (b"2")
            self.tables = open_kvtier_tables(env, self.path, self.readonly, pointers=self._pointers)
        except CORRUPT_LMDB_ERRORS as exc:
            env.close()
            raise CorruptCacheError(f"the tables in {self.path} are damaged: {exc}") from exc
        except lmdb.Error as exc:
            env.close()
            raise _said(exc, f"no space left to create the tables in {self.path}",
                        f"cannot open tables in {self.path}") from exc
        except BaseException:
            env.close()
            raise
        self.env = env
        self._opened = True
        self.map_size_read = float(env.info()["map_size"])  # statistics() while a remap runs

    def open_with_index(self, map_size_bytes: int, eviction_policy: str, *,
                        build_index: bool = True) -> Tuple[ByteLru, int]:
        """``open``, clear stale reader slots, build the eviction index (``build_index``; else an
        empty one, for ``load_index`` later) and read the sequence; a writable open also reclaims
        orphan segments. Returns (index, sequence). LMDB errors are kvtier's; on any failure the
        environment is closed again (opening thread)."""
        self.open(map_size_bytes)
        try:
            self.counters.count(stale_readers_cleared=self.env.reader_check())
            if build_index:
                lru, sequence = self.read_at_open(lambda txn: (self._index_in(txn, eviction_policy),
                                                               read_sequence(txn, self.tables)))
            else:
                lru = make_byte_index(eviction_policy)
                sequence = self.read_at_open(lambda txn: read_sequence(txn, self.tables))
            if not self.readonly:
                self._reclaim_segment_orphans()
        except BaseException as exc:
            self.env.close()
            if isinstance(exc, CORRUPT_LMDB_ERRORS):
                raise CorruptCacheError(f"the LMDB environment in {self.path} is damaged: {exc}") from exc
            if isinstance(exc, lmdb.Error):
                raise TierIOError(f"cannot read the index of {self.path}: {exc}") from exc
            raise
        return lru, sequence

    def _index_in(self, txn: "lmdb.Transaction[memoryview]", eviction_policy: str) -> ByteLru:
        # (last access, key, stored bytes), older first (equal times in key order, as listed), by
        # ``eviction_policy``. Sorted in pieces merged lazily: one sort of a million entries holds
        # the GIL for a second, and the event loop of the process with it.
        entries = index_entries(txn, self.tables)
        by_time = operator.itemgetter(0)
        pieces = [sorted(entries[i : i + _SORT_PIECE], key=by_time) for i in range(0, len(entries), _SORT_PIECE)]
        ordered = heapq.merge(*pieces, key=by_time)  # stable: ties keep the pieces' (key) order
        return make_byte_index(eviction_policy, ((key, size) for _, key, size in ordered))

    def load_index(self, eviction_policy: str) -> ByteLru:
        """The eviction index of what the environment holds now, read in one transaction: an open
        with ``build_index=False`` has the writer thread build it before its first write, so the
        open does not grow with the number of records. LMDB errors are ``TierIOError``."""
        return self.read_txn(lambda txn: self._index_in(txn, eviction_policy))

    def _reclaim_segment_orphans(self) -> None:
        """Truncate or delete what a crash between a segment append and its commit left behind. The
        committed ends are read by ``reclaim_orphans`` itself, in a transaction begun only once it
        holds every file it decides on (its docstring says why nothing a live writer committed, or
        will commit, is touched)."""
        try:
            removed, truncated = reclaim_orphans(
                self.path, lambda: self.read_at_open(lambda txn: committed_ends(txn, self.tables.writable_segments)))
        except OSError as exc:
            raise TierIOError(f"cannot reclaim orphan segments in {self.path}: {exc}") from exc
        if removed or truncated:
            log.warning("kvtier lmdb: %s: removed %d orphan segments, truncated %d orphan tails",
                        self.path, removed, truncated)

    def reopen(self) -> None:
        """After MDB_PANIC the environment must be reopened (writer thread, exclusive lock)."""
        self._sound_at_open = False  # a panic: let the next open walk the file
        with self.map_lock.exclusive():
            size = self.env.info()["map_size"]
            self.env.close()
            self.open(size)

    def close(self) -> None:
        """Close the environment (once every thread that used it is done); a writable one verified
        at open is stamped so the next open need not walk it (``recovery.stamp_verified``)."""
        with self.map_lock.exclusive():
            self.env.close()
        if self._sound_at_open and not self.readonly:
            stamp_verified(self.path)

    def read_at_open(self, body: Callable[["lmdb.Transaction[memoryview]"], T]) -> T:
        """``body`` in a new read transaction while opening (LMDB errors propagate to the caller,
        which maps them), adopting a map another process grew since we opened it."""
        for attempt in range(3):
            try:
                with self.env.begin(buffers=True) as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                if attempt == 2:
                    raise
                self.env.set_mapsize(0)
        raise AssertionError("unreachable")

    def read_txn(self, body: Callable[["lmdb.Transaction[memoryview]"], T]) -> T:
        """Run ``body`` in a read transaction under the shared map lock (any thread but the writer)."""
        for attempt in range(3):
            try:
                with self.map_lock.shared():
                    with self.env.begin(buffers=True) as txn:
                        self.io_hook.before("read")
                        return body(txn)
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size (no transaction may be open here).
                with self.map_lock.exclusive():
                    self.env.set_mapsize(0)
            except lmdb.Error as exc:
                self.counters.count(errors=1)
                raise TierIOError(f"LMDB read failed in {self.path}: {exc}") from exc
        raise TierIOError(f"LMDB map of {self.path} keeps being resized by another process")

    def map_size_nowait(self, closed: bool) -> float:
        """The map size for statistics(): read under the shared map lock, as every read
        transaction (a remap runs under the exclusive one, and LMDB's info reads the meta pages
        inside the map); while that lock is taken, the size last read. 0 once closed."""
        with self.map_lock.shared_nowait() as held:
            if held and not closed:
                try:
                    self.map_size_read = float(self.env.info()["map_size"])
                except lmdb.Error:
                    self.map_size_read = 0.0
        return self.map_size_read if not closed else 0.0


def _said(exc: lmdb.Error, full: str, failed: str) -> Exception:
    """An LMDB error of opening as kvtier's: ``TierFullError`` for no space, else ``TierIOError``."""
    if is_disk_full(exc):
        return TierFullError(f"{full}: {exc}")
    return TierIOError(f"{failed}: {exc}")
