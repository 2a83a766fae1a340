"""Recovery and structure checks of an LMDB cache directory, before LMDB maps it.

Primitives (blocking; called by ``LmdbTier`` while opening, on the opening thread, and by the engine
when it moves a damaged directory aside):

- ``check_data_file``: refuse a truncated ``data.mdb`` (LMDB would read past its end: SIGBUS), and
  a missing or empty one beside payload segment files (a lost index, not a new cache).
- ``structure_walk_due``: whether an open would walk the file now (a quick look, no lock).
- ``verify_structure_at_rest``: py-lmdb's offline verifier over the whole file, only when no other
  process has the environment open and the file changed since a verified open closed it cleanly
  (``stamp_verified``).
- ``stamp_verified``: after a clean close of an environment this process had verified (or found
  stamped), note the file's identity beside it, so the next open need not walk it again.
- ``quarantine_cache_dir``: move a damaged environment's files aside so a fresh one can be made.
- ``open_replacing_damaged`` (async, the opener's event loop): open a cache directory, and when it
  is damaged move it aside and open a fresh one: how every serving process (the engine, vLLM's
  tier) starts on a cache directory.
- ``CORRUPT_LMDB_ERRORS``: the LMDB errors that mean "these bytes are not a sound environment".
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import struct
import time
from pathlib import Path
from typing import Awaitable, Callable, List, Optional, Tuple, TypeVar, Union

import lmdb

from kvtier.errors import CorruptCacheError, TierIOError

from .segment_files import segment_files

__all__ = ["CORRUPT_LMDB_ERRORS", "check_data_file", "structure_walk_due", "verify_structure_at_rest", "stamp_verified",
           "quarantine_cache_dir", "open_replacing_damaged"]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
T = TypeVar("T")

# LMDB's on-disk meta pages (64-bit builds, LMDB 0.9): pages 0 and 1 each hold a 16-byte page header
# then MDB_meta: magic u32 | version u32 | address | mapsize | 2 x MDB_db (48 bytes; the first one's
# md_pad is the page size) | last_pg | txnid.
_MDB_MAGIC = 0xBEEFC0DE
_MDB_DATA_VERSION = 1
_META_MAGIC = struct.Struct("<II")  # at 16
_META_PSIZE = struct.Struct("<I")  # at 40
_META_TAIL = struct.Struct("<QQ")  # last_pg, txnid at 136
_META_ROOTS = ((struct.Struct("<Q"), 80), (struct.Struct("<Q"), 128))  # md_root of the free and main DBs
_P_INVALID = (1 << 64) - 1  # an empty tree's root
_META_MAPSIZE = struct.Struct("<Q")  # the map size at the meta page's commit, at 32
# LMDB errors that mean "these bytes are not a sound LMDB environment", as opposed to a busy lock,
# a permission or a full disk: they make the directory a candidate for quarantine.
CORRUPT_LMDB_ERRORS = (
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.BadTxnError,
    lmdb.BadValsizeError,
    lmdb.BadDbiError,
    lmdb.IncompatibleError,
    lmdb.PanicError,
)


def check_data_file(directory: Path) -> None:
    """Refuse a ``data.mdb`` that LMDB would map and then read past its end (SIGBUS): a file shorter
    than its meta pages or than the last page the newest meta page says is in use.

    The meta pages are read before the size, so a live writer in another process (which only grows
    the file, and writes the pages a meta page names before the meta page itself) is never taken for
    truncation. Anything that is not even an LMDB header is left to LMDB, which names it.
    """
    path = directory / "data.mdb"
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024 + 160)
            size = os.fstat(f.fileno()).st_size
            if len(head) < 160:
                if size == 0:
                    _refuse_lost_index(directory, "is empty")
                    return  # an empty file: LMDB initialises it as a new environment
                raise CorruptCacheError(f"{path} is truncated: {size} bytes, not even one meta page")
            magic, version = _META_MAGIC.unpack_from(head, 16)
            if magic != _MDB_MAGIC or version != _MDB_DATA_VERSION:
                return  # not an LMDB file at all, or another version: LMDB says which
            (psize,) = _META_PSIZE.unpack_from(head, 40)
            if psize < 512 or psize > 65536 or psize & (psize - 1):
                raise CorruptCacheError(f"{path} has a corrupt meta page (page size {psize})")
            f.seek(psize)
            meta1 = f.read(160)
    except FileNotFoundError:
        _refuse_lost_index(directory, "is missing")
        return
    except OSError as exc:
        raise TierIOError(f"cannot read {path}: {exc}") from exc
    metas = [head[:160]]
    if len(meta1) == 160:
        metas.append(meta1)
    newest: Optional[Tuple[int, int, int, int]] = None  # (txnid, last_pg, highest root, map size)
    for meta in metas:
        magic, version = _META_MAGIC.unpack_from(meta, 16)
        if magic != _MDB_MAGIC or version != _MDB_DATA_VERSION:
            continue
        last_pg, txnid = _META_TAIL.unpack_from(meta, 136)
        roots = [root for field, at in _META_ROOTS if (root := field.unpack_from(meta, at)[0]) != _P_INVALID]
        if newest is None or txnid > newest[0]:
            newest = (txnid, last_pg, max(roots, default=1), _META_MAPSIZE.unpack_from(meta, 32)[0])
    assert newest is not None  # meta page 0 passed the same check above
    _, last_pg, highest_root, map_size = newest
    # last_pg is the last page allocated, not the last one written: a commit can allocate a page
    # and free it again without writing it, so a healthy file may end before it (LMDB never reads
    # a free page; reusing one, it writes it whole). The trees' roots must be in the file, and
    # last_pg inside the map of its commit (past that the meta page is damaged, and LMDB would map
    # that many pages: ENOMEM, or a map far past the file). A file that ends before last_pg is
    # then walked by the offline verifier: refused only if a page some tree reaches is missing.
    needed = max(2, highest_root + 1) * psize
    if size < needed:
        raise CorruptCacheError(
            f"{path} is truncated: {size} bytes, but its meta page roots a tree at page {highest_root} "
            f"(needs {needed}, page size {psize})"
        )
    if (last_pg + 1) * psize > max(map_size, size):
        raise CorruptCacheError(
            f"{path} has a corrupt meta page: last page {last_pg} lies past its map of {map_size} bytes "
            f"(page size {psize})"
        )
    if size < (last_pg + 1) * psize:
        # Not walked when another process has the environment open: its writer grows the file
        # and writes every page a meta page reaches before that meta page.
        missing = [p for p in _problems_at_rest(directory, create_lock=False) or [] if "beyond EOF" in p]
        if missing:
            raise CorruptCacheError(f"{path} is truncated: {size} bytes, and {'; '.join(missing[:3])}")


def _refuse_lost_index(directory: Path, what: str) -> None:
    """A missing or empty ``data.mdb`` is a new cache only where no payload segment files lie
    beside it: with them it is a lost index (``: > data.mdb``, a deleted file), and opening it as
    new would create an empty index and then delete every segment as an orphan."""
    try:
        found = segment_files(directory)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TierIOError(f"cannot list {directory}: {exc}") from exc
    if found:
        raise CorruptCacheError(
            f"{directory / 'data.mdb'} {what} but {len(found)} payload segment files (seg-*.kvs) lie beside it: "
            "the index that points into them is lost (damaged, not a new cache)"
        )


# Beside data.mdb after a clean close of a verified environment: the file's identity then.
VERIFIED_STAMP = ".kvtier-verified"
# Both meta pages lie in the first two pages (at most 64 KiB each): every commit rewrites one.
_META_BYTES = 128 * 1024


def _identity(data: Path) -> Optional[str]:
    """What changes with every write to ``data``: its inode, size, modification and change times
    (the change time cannot be set back from user space) and a hash of its meta pages (every LMDB
    commit rewrites one, with a new transaction id, even within one clock tick). None if unreadable."""
    try:
        with open(data, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(_META_BYTES)
    except OSError:
        return None
    return json.dumps([st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                       hashlib.blake2b(head, digest_size=16).hexdigest()])


def stamp_verified(directory: Path) -> None:
    """After a clean close of an environment whose structure this process trusted at open (it
    verified it, or found it stamped and unchanged): note ``data.mdb``'s identity in
    ``VERIFIED_STAMP``, so that an open finding the file unchanged skips the walk (blocking; a
    failure only costs the next open a walk)."""
    identity = _identity(directory / "data.mdb")
    if identity is None:
        return
    temp = directory / f"{VERIFIED_STAMP}.{os.getpid()}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(identity)
        os.replace(temp, directory / VERIFIED_STAMP)
    except OSError as exc:
        log.debug("kvtier lmdb: cannot stamp %s as verified: %s", directory, exc)
        temp.unlink(missing_ok=True)


def _stamped_unchanged(directory: Path) -> bool:
    try:
        stamp = (directory / VERIFIED_STAMP).read_text()
    except OSError:
        return False
    return stamp == _identity(directory / "data.mdb")


def structure_walk_due(directory: Path) -> bool:
    """Whether an open with the structure check would walk ``data.mdb`` now: the file is there, not
    empty, and not unchanged since a verified clean close (``stamp_verified``). A quick look (a
    stat, the stamp, the meta pages), without the lock: the walk itself still decides under it
    (``verify_structure_at_rest``), skipping an environment another process has open."""
    try:
        if os.stat(directory / "data.mdb").st_size == 0:
            return False
    except OSError:
        return False
    return not _stamped_unchanged(directory)


def verify_structure_at_rest(directory: Path, *, create_lock: bool = True) -> bool:
    """Check ``data.mdb`` with py-lmdb's offline verifier when no other process has the environment
    open; raise ``CorruptCacheError`` listing what it found. Returns True when the file is known
    sound: verified now, or unchanged since a verified open closed it (``stamp_verified``).

    The walk reads the whole file (~5 us a record), so an unchanged file is not walked again: damage
    from outside (another program, a bad copy, a truncation, a crash of a writer that was not
    LMDB's) comes through writes, and every write changes the identity the stamp holds. What it
    does not catch is the medium itself rotting under an unchanged file, as no check at open could
    while the file is served.

    "No other process" is LMDB's own test: the exclusive lock on byte 0 of ``lock.mdb`` that every
    opener tries first. It is held while the verifier reads, so an opener elsewhere waits for it (as
    it would for any first opener). A live environment is not checked: another process may be
    writing it, and it is being served, so it cannot be damaged in a way LMDB has not met already.
    The caller must not have the environment open in this process (closing our descriptor drops
    every fcntl lock this process holds on the file): the tier's one-open-per-process registry guarantees it.
    ``create_lock=False`` (a read-only open) never creates ``lock.mdb``: without one no process has
    the environment open, so the file is checked without taking the lock.
    """
    try:
        if os.stat(directory / "data.mdb").st_size == 0:
            return True  # LMDB makes a new environment: sound by construction
    except FileNotFoundError:
        return True
    except OSError:
        pass
    problems = _problems_at_rest(directory, create_lock=create_lock, skip_if_stamped=True)
    if problems:
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CorruptCacheError(f"the LMDB file {directory / 'data.mdb'} is damaged: {shown}{more}")
    return problems is not None


def _problems_at_rest(directory: Path, *, create_lock: bool, skip_if_stamped: bool = False) -> Optional[List[str]]:
    """What py-lmdb's offline verifier finds in ``data.mdb`` (``[]``: nothing, or, with
    ``skip_if_stamped``, unchanged since a verified clean close), or ``None`` when it was not run:
    no file, the environment open in another process (see ``verify_structure_at_rest``), no
    verifier in this py-lmdb, a file it cannot even begin on (``lmdb.open`` names that), or an OS
    error taking the lock."""
    data = directory / "data.mdb"
    if not data.exists():
        return None
    try:
        from lmdb import verify as lmdb_verify
    except ImportError:  # py-lmdb before 3.0: no offline verifier
        log.debug("kvtier lmdb: lmdb.verify unavailable, %s opened unverified", directory)
        return None
    fd = -1
    try:
        if create_lock or (directory / "lock.mdb").exists():
            fd = os.open(directory / "lock.mdb", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
            except OSError:
                return None  # open in another process: see verify_structure_at_rest
        if skip_if_stamped and _stamped_unchanged(directory):  # under the lock: no writer now
            return []
        try:
            return list(lmdb_verify.verify(str(directory)))
        except lmdb_verify.VerifyError:
            return None
        except (OSError, ValueError, struct.error, IndexError) as exc:
            return [f"the verifier stopped: {exc!r}"]
    except OSError as exc:
        log.debug("kvtier lmdb: cannot verify %s at rest (%s)", directory, exc)
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def quarantine_cache_dir(path: PathLike) -> Path:
    """Move a damaged environment's files (``data.mdb``, ``lock.mdb`` and its payload segments
    ``seg-*.kvs``, useless without that index: only what kvtier owns) aside
    into a new directory ``<dir>.corrupt-<UTC time>-<pid>`` next to it, and return that path.
    Blocking. Nothing else in the directory is touched, and the directory itself stays, so this
    works when it is a mount point (renaming a mount point fails with EBUSY) and never moves other
    people's files. When the sibling is on another filesystem (the directory is a mount point, or
    its parent cannot be written), the aside directory is made inside: ``<dir>/.kvtier-corrupt-...``.
    The files are kept (mode unchanged) for inspection; nothing in them is read again. Raises
    ``TierIOError`` when they cannot be moved."""
    src = Path(os.fspath(path)).expanduser().absolute()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    try:
        segments = segment_files(src)
    except OSError:
        segments = []
    owned = [src / name for name in ("data.mdb", "lock.mdb", VERIFIED_STAMP, *segments) if (src / name).exists()]
    errors: List[str] = []
    for parent, prefix in ((src.parent, f"{src.name}.corrupt"), (src, ".kvtier-corrupt")):
        if parent == src.parent and os.path.ismount(src):
            continue  # a rename out of a mount point is EXDEV: go straight to the inside
        dst = _new_aside_dir(parent, f"{prefix}-{stamp}-{os.getpid()}", errors)
        if dst is None:
            continue
        try:
            for file in owned:
                os.rename(file, dst / file.name)
        except OSError as exc:
            errors.append(f"{dst}: {exc}")
            for file in owned:  # put back what moved, so the next try moves all or none
                if (dst / file.name).exists() and not file.exists():
                    os.rename(dst / file.name, file)
            try:
                dst.rmdir()
            except OSError:
                pass
            continue
        log.error("kvtier lmdb: damaged LMDB files of %s moved aside to %s", src, dst)
        return dst
    raise TierIOError(f"cannot move the damaged LMDB files of {src} aside: {'; '.join(errors)}")


def _new_aside_dir(parent: Path, name: str, errors: List[str]) -> Optional[Path]:
    dst = parent / name
    n = 0
    while True:
        try:
            os.mkdir(dst, 0o700)
            return dst
        except FileExistsError:
            n += 1
            dst = parent / f"{name}-{n}"
        except OSError as exc:
            errors.append(f"{dst}: {exc}")
            return None


async def open_replacing_damaged(path: PathLike, open_tier: Callable[[], Awaitable[T]], *,
                                 quarantine: bool) -> Tuple[T, Optional[Path]]:
    """``await open_tier()`` (which opens the cache directory at ``path``); when it raises
    ``CorruptCacheError`` and ``quarantine`` is true, move the damaged files aside
    (``quarantine_cache_dir``, on a worker thread), log where, and open again: an empty directory.
    Returns the tier and where the damaged files went (``None`` when nothing was moved). With
    ``quarantine`` false the error propagates and the directory is left alone. Cancelling it: a
    move already started finishes on its thread (the files are then aside), and nothing is opened
    after it."""
    try:
        return await open_tier(), None
    except CorruptCacheError as exc:
        if not quarantine:
            raise
        aside = await asyncio.get_running_loop().run_in_executor(None, quarantine_cache_dir, path)
        log.error("cache directory %s is damaged (%s); moved aside to %s, starting with an empty one",
                  path, exc, aside)
    return await open_tier(), aside
