"""A segment file's life in its directory: names, who holds a file, deleting dead ones, reclaiming
what a crash left (the file side of ``segments``; see its docstring for the promises).

Primitives: ``NAME_PATTERN`` / ``segment_files`` (any thread), ``held_by_writer`` (any thread: a
probe of a file's writer lock), ``creation_lock`` (``segments.lock``: shared while a writer creates
and locks a segment, exclusive while an open reclaims orphans), ``remove_dead`` (writer thread,
after the commit that emptied the files), ``reclaim_orphans`` (a writable open), and
``close_quietly`` / ``io_error`` (the small OS helpers both sides use). It imports nothing of the
segment writer or reader: what it needs of them is a protocol each (``RotatesSegments``,
``ForgetsSegments``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

from kvtier.errors import TierFullError, TierIOError

__all__ = [
    "NAME_PATTERN",
    "segment_files",
    "held_by_writer",
    "creation_lock",
    "remove_dead",
    "reclaim_orphans",
    "close_quietly",
    "io_error",
    "ForgetsSegments",
    "RotatesSegments",
]

log = logging.getLogger(__name__)

NAME_PATTERN = _NAME = re.compile(r"^seg-([0-9]+)-([0-9]+)\.kvs$")  # pid, number
_CREATION_LOCK = "segments.lock"


class ForgetsSegments(Protocol):
    """What ``remove_dead`` needs of a reader (``segment_reader.SegmentReader``): to drop its fds
    of deleted segments. A protocol, so this module never imports the reader that imports it."""

    def forget(self, names: Iterable[str]) -> None: ...


class RotatesSegments(Protocol):
    """What ``remove_dead`` needs of this process's segment writer (``segments.SegmentWriter``):
    its active segment, closed (``rotate``) before that file is deleted."""

    @property
    def active(self) -> Optional[str]: ...

    def rotate(self) -> None: ...


def close_quietly(fd: int) -> None:
    """Close a read descriptor; a failure is logged (it is released whatever close says)."""
    try:
        os.close(fd)
    except OSError as exc:
        log.warning("kvtier lmdb: closing a segment read descriptor failed: %s", exc)


def io_error(exc: OSError, what: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(f"{what}: disk full: {exc}")
    return TierIOError(f"{what}: {exc}")


def _locked_elsewhere(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def _still_named(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd`` (not unlinked since it was opened)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def held_by_writer(directory: Path, name: str) -> Optional[bool]:
    """Whether a writer (of any process, this one included) still holds segment ``name``'s lock,
    i.e. may append to it; ``None`` when the file does not exist. Compaction leaves held ones."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        return _locked_elsewhere(fd)
    finally:
        os.close(fd)  # drops the lock the probe may have taken


def segment_files(directory: Path) -> List[str]:
    """Names of the segment files in ``directory``."""
    return sorted(name for name in os.listdir(directory) if _NAME.match(name))


def remove_dead(directory: Path, names: Iterable[str], writer: Optional[RotatesSegments],
                reader: ForgetsSegments) -> List[str]:
    """After the commit that emptied ``names``: delete each segment file, unless a writer still
    appends to it (ours is rotated first; another process's keeps its lock: left for later).
    Returns the names deleted. Never raises: it runs after a commit, which must stand whatever
    the files do; a file that cannot be deleted (a permission, an I/O error) is logged and left
    without an entry in ``segments``, an orphan the next writable open deletes."""
    removed = []
    for name in names:
        if writer is not None and writer.active == name:
            writer.rotate()
        reader.forget([name])
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("kvtier lmdb: cannot open emptied segment %s to delete it (left for the next open): %s", path, exc)
            continue
        try:
            if _locked_elsewhere(fd):
                continue
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kvtier lmdb: cannot delete emptied segment %s (left for the next open): %s", path, exc)
        finally:
            close_quietly(fd)
    return removed


@contextlib.contextmanager
def creation_lock(directory: Path, mode: int) -> Iterator[None]:
    """``segments.lock``: shared while a writer creates and locks a segment, exclusive while an open
    looks for orphans."""
    try:
        fd = os.open(directory / _CREATION_LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise io_error(exc, f"cannot open {directory / _CREATION_LOCK}") from exc
    try:
        try:
            fcntl.flock(fd, mode)
        except OSError as exc:
            raise io_error(exc, f"cannot lock {directory / _CREATION_LOCK}") from exc
        yield
    finally:
        os.close(fd)


def reclaim_orphans(directory: Path, committed: Callable[[], Dict[str, int]]) -> Tuple[int, int]:
    """At a writable open: delete segment files no committed record points into and truncate each
    other one to its committed end (what a crash between ``append`` and the commit left behind),
    skipping segments a live writer holds. ``committed``: reads segment name -> committed end in a
    NEW read transaction (called once, after every file it decides on is locked). Returns (files
    removed, files truncated).

    Why it cannot take a live writer's records, whatever the interleaving (W: a writer in another
    process, R: this reclaim):

    - R holds ``segments.lock`` exclusively throughout; W creates and ``flock``s every new segment
      under it shared. So each file R lists was created, and locked by its writer, before R began.
    - R takes each file's ``flock`` (non-blocking; a file whose lock is held is some writer's active
      segment and is left alone), and only then reads the committed ends, in a transaction begun
      after the last of those locks. A writer appends only to its active segment and commits every
      pointer into it before it releases the lock (``rotate`` comes after the commit; a failed
      append rotates before any commit), so every commit that will ever point into a file R holds
      has happened before R's lock, and so before R's transaction: the end R reads is final, and a
      file R finds without an entry has no committed record and never will.
    - While R holds a file's lock, nobody appends to it (names never repeat, so no writer creates
      it again) and ``remove_dead`` elsewhere leaves it for later. R truncates only bytes past the
      committed end, deletes only files without one, then drops its locks.

    Reading the ends first and locking afterwards (as before) let a writer commit into a segment
    and release it in between (its records cut off), or create, fill and release a new one (deleted
    whole)."""
    if not any(_NAME.match(name) for name in os.listdir(directory)):
        return 0, 0  # nothing to look at: no lock file created for caches without segments
    with creation_lock(directory, fcntl.LOCK_EX):
        held: List[Tuple[str, int]] = []
        try:
            for name in segment_files(directory):
                try:
                    fd = os.open(directory / name, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    continue  # deleted meanwhile (an emptied segment)
                if _locked_elsewhere(fd) or not _still_named(directory / name, fd):
                    # Held by a writer, or deleted by another process's remove_dead between our
                    # open and our lock (it deletes under the lock, then drops it): not ours.
                    os.close(fd)
                    continue
                held.append((name, fd))
            ends = committed() if held else {}
            return _reclaim(directory, held, ends)
        finally:
            for _, fd in held:
                os.close(fd)


def _reclaim(directory: Path, held: List[Tuple[str, int]], ends: Dict[str, int]) -> Tuple[int, int]:
    removed = truncated = 0
    for name, fd in held:
        end = ends.get(name)
        if end is None:
            os.unlink(directory / name)
            removed += 1
        elif os.fstat(fd).st_size > end:
            os.ftruncate(fd, end)
            os.fsync(fd)
            truncated += 1
    return removed, truncated
