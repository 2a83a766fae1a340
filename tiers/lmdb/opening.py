"""The steps around ``lmdb.open`` that keep opening a cache directory safe.

Primitives (blocking; run by ``LmdbTier`` while opening, on the opening thread):

- ``DirectorySnapshot``: what of the directory existed before the open, so that an open that fails
  for lack of space leaves the directory as it was (files it created removed, a directory it made
  removed when empty).
- ``prepare_lock_file``: allocate ``lock.mdb`` before LMDB maps it. LMDB sizes the lock file with
  ``ftruncate`` (a sparse file) and then writes it through ``mmap``: on a full disk the first write
  to an unallocated page is SIGBUS, which kills the whole process without a word. Allocating it
  with ``posix_fallocate`` first turns that into ENOSPC, said as ``TierFullError``.
- ``lock_for_readonly``: the same for a read-only opener, which must use the lock file too: only
  reads listed in its reader table keep a writer (in any process, opening later) from reusing the
  pages they read. Creating it is acceptable for a read-only open: ``lock.mdb`` holds no cached
  data, only LMDB's reader slots, and the directory is the same user's (0700, owner checked by
  ``safedir``); ``data.mdb`` and the segments are never written. Where it cannot be written (a
  read-only mount, no permission, no space) the open goes without it, and says so: the tier then
  copies every record out of the map before checking it.
- ``open_kvtier_tables``: ``tables.open_tables`` that adopts a map another process grew
  (``MDB_MAP_RESIZED``, retried like every read and write) and refuses an environment kvtier did
  not create (another program's LMDB), before writing anything into it.
- ``is_disk_full``: whether an LMDB or OS error means "no space left".
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional

import lmdb

from kvtier.errors import CorruptCacheError, TierFullError, TierIOError

from .tables import FORMAT_VERSION, Tables, open_tables

__all__ = ["DirectorySnapshot", "prepare_lock_file", "lock_for_readonly", "open_kvtier_tables", "is_disk_full"]

# LMDB's lock file for py-lmdb's default 126 readers (kvtier's): 8 KiB, 64-byte reader slots plus
# a header. Exactly that: a larger file would only raise LMDB's reader limit.
LOCK_FILE_BYTES = 8 * 1024
# The named databases of a kvtier environment (tables.py): anything else in the main database
# means another program's LMDB.
_KVTIER_TABLES = frozenset({b"chunks", b"atime", b"quarantine", b"meta", b"segments"})
_CORE_TABLES = frozenset({b"chunks", b"atime", b"quarantine", b"meta"})  # every kvtier cache has these
_MAP_RESIZED_ATTEMPTS = 3


def is_disk_full(exc: BaseException) -> bool:
    """True for ENOSPC / EDQUOT, from the OS or as LMDB words it."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


class DirectorySnapshot:
    """Which of a cache directory and its LMDB files existed before an open (see the module
    docstring); ``restore()`` removes what the open created. Taken before the directory is made."""

    _FILES = ("data.mdb", "lock.mdb")

    def __init__(self, path: "os.PathLike[str] | str") -> None:
        self.path = Path(os.fspath(path)).expanduser()
        self.existed = self.path.exists()
        self.files = {name for name in self._FILES if (self.path / name).exists()} if self.existed else set()

    def restore(self) -> None:
        """Remove the LMDB files and the directory this open created; never anything else."""
        for name in self._FILES:
            if name not in self.files:
                try:
                    (self.path / name).unlink()
                except OSError:
                    pass
        if not self.existed:
            try:
                self.path.rmdir()  # only when empty: anything else in it is not ours to remove
            except OSError:
                pass


# Why a read-only opener cannot have a lock file it may write: a read-only mount, no permission.
_CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM)


def lock_for_readonly(directory: Path) -> bool:
    """Give a read-only open LMDB's lock file: use ``lock.mdb``, creating it (allocated, as
    ``prepare_lock_file``) when missing; True when the open can use it. False when it cannot be
    written (a read-only mount, no permission, no space to allocate it): the open must then go
    without LMDB's lock, its reads in no reader table (see the module docstring), and nothing is
    left behind. A new lock file appears whole: it is allocated under a private name and linked
    into place, so no other opener ever maps a half-made one."""
    path = directory / "lock.mdb"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            made = _link_new_lock_file(directory)
            if made is None:
                continue  # another opener linked one first: use it
            return made
        except OSError as exc:
            if exc.errno in _CANNOT_WRITE:
                return False
            raise TierIOError(f"cannot open {path}: {exc}") from exc
        return _allocated_and_closed(fd, directory)
    raise TierIOError(f"{path} keeps appearing and disappearing while it is opened")


def _link_new_lock_file(directory: Path) -> Optional[bool]:
    """``lock.mdb`` made under a private name and linked into place: True when linked, False when
    it cannot be made here, None when another opener's appeared first."""
    temp = directory / f".lock.mdb-{os.getpid()}-{os.urandom(6).hex()}"
    try:
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in _CANNOT_WRITE or is_disk_full(exc):
            return False
        raise TierIOError(f"cannot create {temp}: {exc}") from exc
    try:
        if not _allocated_and_closed(fd, directory):
            return False
        try:
            os.link(temp, directory / "lock.mdb")
        except FileExistsError:
            return None
        except OSError as exc:
            if exc.errno in _CANNOT_WRITE or exc.errno in (errno.EOPNOTSUPP, errno.EMLINK):
                return False  # no hard links here: go without, rather than map a half-made file
            raise TierIOError(f"cannot create {directory / 'lock.mdb'}: {exc}") from exc
        return True
    finally:
        try:
            os.unlink(temp)
        except OSError:
            pass


def prepare_lock_file(directory: Path) -> None:
    """Make sure ``lock.mdb`` exists with its pages allocated, so LMDB's writes through its mapping
    cannot fault on a full disk. Raises ``TierFullError`` when there is no room for it."""
    path = directory / "lock.mdb"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if is_disk_full(exc):
            raise TierFullError(f"no space left on the device of {directory} to create lock.mdb") from exc
        raise TierIOError(f"cannot create {path}: {exc}") from exc
    try:
        _allocate_lock_file(fd, directory)
    finally:
        os.close(fd)


def _allocated_and_closed(fd: int, directory: Path) -> bool:
    """``_allocate_lock_file`` for a read-only opener, closing ``fd``: False when there is no room
    (the open then goes without the lock file)."""
    try:
        _allocate_lock_file(fd, directory)
    except TierFullError:
        return False
    finally:
        os.close(fd)
    return True


def _allocate_lock_file(fd: int, directory: Path) -> None:
    """Allocate the lock file's pages (``TierFullError`` when there is no room)."""
    try:
        # Allocates holes only: an existing lock file's contents (a live environment's readers)
        # are untouched, and a file already this large is left as it is.
        os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    except OSError as exc:
        if is_disk_full(exc):
            raise TierFullError(
                f"no space left on the device of {directory} for LMDB's lock file "
                f"({LOCK_FILE_BYTES} bytes); free some space or use another cache directory"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate
            raise TierIOError(f"cannot allocate {directory / 'lock.mdb'}: {exc}") from exc


def _refuse_foreign(env: lmdb.Environment, path: object) -> None:
    """Refuse an environment kvtier did not create (``TierIOError``: never write into another
    program's database), but call a kvtier environment with damaged names or marker what it is,
    ``CorruptCacheError`` (the engine then moves it aside): kvtier creates its tables and the format
    marker in one transaction, so its table names with a table or the marker missing, or a name one
    or two bytes away from a missing one of its own, are damage, not another program."""
    with env.begin() as txn:
        names = {bytes(key) for key in txn.cursor().iternext(keys=True, values=False)}
    if not names:
        return  # a new, empty environment: kvtier creates its tables in it
    foreign = sorted(names - _KVTIER_TABLES)
    missing = _KVTIER_TABLES - names
    if foreign:
        shown = ", ".join(repr(n)[2:-1] for n in foreign[:5])
        if all(_near_any(name, missing) for name in foreign):
            raise CorruptCacheError(f"{path} has damaged LMDB table names ({shown}, where kvtier's "
                                    f"{', '.join(sorted(repr(n)[2:-1] for n in missing))} should be)")
        raise TierIOError(
            f"{path} holds an LMDB environment kvtier did not create ({shown}); kvtier refuses to "
            "write into another program's database: use an empty directory as the cache directory"
        )
    if b"meta" not in names:
        raise CorruptCacheError(f"{path} has kvtier's LMDB tables but not its 'meta' table (damaged)")
    meta = env.open_db(b"meta", create=False)
    with env.begin() as txn:
        marker = txn.get(b"format", db=meta)
    if marker is None:
        if _CORE_TABLES <= names:
            raise CorruptCacheError(f"{path} has kvtier's LMDB tables but its format marker is gone (damaged)")
        raise TierIOError(
            f"{path} holds an LMDB environment kvtier did not create (its 'meta' table has no kvtier "
            "format marker); use an empty directory as the cache directory"
        )
    if marker == FORMAT_VERSION and b"segments" not in names:
        # A cache that may hold segment pointers was created with its segments table (every
        # writable open creates it): without it the ledger of every segment file is lost, and a
        # writable open would take the files for orphans and delete every payload.
        raise CorruptCacheError(f"{path} is a tier format {marker!r} cache without its 'segments' table (damaged)")


def _near_any(name: bytes, candidates: "frozenset[bytes] | set[bytes]") -> bool:
    """Whether ``name`` is one of ``candidates`` with at most two bytes changed (a bit flip)."""
    return any(len(name) == len(c) and sum(a != b for a, b in zip(name, c)) <= 2 for c in candidates)


def open_kvtier_tables(env: lmdb.Environment, path: object, readonly: bool, *, pointers: bool = False) -> Tables:
    """``open_tables``, refusing a foreign environment first and retrying when another process grew
    the map meanwhile (``MDB_MAP_RESIZED``: adopt the new size with ``set_mapsize(0)``)."""
    last: Optional[BaseException] = None
    for _ in range(_MAP_RESIZED_ATTEMPTS):
        try:
            _refuse_foreign(env, path)
            return open_tables(env, path, readonly, pointers=pointers)
        except lmdb.MapResizedError as exc:
            last = exc
            env.set_mapsize(0)  # no transaction is open here
    raise TierIOError(f"the LMDB map of {path} keeps being resized by another process") from last

