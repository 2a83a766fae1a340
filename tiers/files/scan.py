"""The file tier's scan of a root: what it holds, and which leftovers are safe to remove.

Primitives (blocking; run on one of the tier's I/O threads, at ``open`` and by ``check``):
``scan_tree`` lists records, leaf directories and the quarantine, creating the root 0700 and removing
stale temp files at open; ``check_root_safe`` refuses a root others could write.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Set, Tuple

from kvtier.errors import UnsafeDirectoryError

from .layout import (
    CONTINUATION_SUFFIX,
    DIR_MODE,
    HOST_TAG,
    QUARANTINE_DIR,
    RECORD_SUFFIX,
    TEMP_SUFFIX,
    fsync_dir,
    key_from_location,
)

__all__ = ["ScanResult", "scan_tree", "check_root_safe"]

_HEX2 = re.compile(r"^[0-9a-f]{2}$")
# ab/cd plus the continuation levels of the longest key (511 bytes: 1022 hex digits, 200 per level).
_MAX_DEPTH = 2 + 5
_TEMP_NAME = re.compile(r"^\.([0-9a-f]+)\.(.+)-(\d+)-([0-9a-f]+)\.tmp$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def check_root_safe(root: Path) -> None:
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"file tier root {root} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"file tier root {root} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
        )
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeDirectoryError(
            f"file tier root {root} is world-writable (mode {stat.S_IMODE(st.st_mode):o}); "
            "anyone could plant or swap records"
        )


@dataclass
class ScanResult:
    entries: List[Tuple[bytes, int, float]]  # key, size, last access
    dirs: Set[Tuple[str, ...]]  # directory components under the root, (ab, cd[, piece.k...])
    temps_removed: int
    quarantined_files: int
    created: bool


@dataclass
class _Found:
    entries: List[Tuple[bytes, int, float]] = field(default_factory=list)
    dirs: Set[Tuple[str, ...]] = field(default_factory=set)
    temps_removed: int = 0


def _scan_leaf(path: str, dirs: Tuple[str, ...], found: _Found, now: float, stale_temp_s: float, create: bool) -> None:
    """Records, temps and continuation directories (long keys) in one leaf directory."""
    found.dirs.add(dirs)
    with os.scandir(path) as leaf:
        for e in leaf:
            name = e.name
            if name.startswith(".") and name.endswith(TEMP_SUFFIX):
                if create and temp_is_stale(e, now, stale_temp_s):
                    try:
                        os.unlink(e.path)
                        found.temps_removed += 1
                    except FileNotFoundError:
                        pass  # its writer renamed or removed it meanwhile
                continue
            if name.endswith(CONTINUATION_SUFFIX) and e.is_dir(follow_symlinks=False):
                if len(dirs) < _MAX_DEPTH:
                    _scan_leaf(e.path, dirs + (name,), found, now, stale_temp_s, create)
                continue
            if not name.endswith(RECORD_SUFFIX):
                continue  # not ours: leave it alone
            key = key_from_location(dirs, name[: -len(RECORD_SUFFIX)])
            if key is None:
                continue  # misplaced: path_for() would never find it
            st = e.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue  # a symlink or device under our root is never served
            found.entries.append((key, st.st_size, max(st.st_atime, st.st_mtime)))


def scan_tree(root: Path, stale_temp_s: float, create: bool) -> ScanResult:
    """Runs on an I/O thread: prepare ``root`` and list what it holds. With ``create`` (open) it
    also creates what is missing and removes stale temp files; without it (``check``) it only
    reads."""
    created = False
    if create and not root.exists():
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)
        # makedirs' mode is filtered by the umask; the contract is 0700 exactly.
        os.chmod(root, DIR_MODE)
        fsync_dir(str(root.parent))
        created = True
    check_root_safe(root)
    qdir = root / QUARANTINE_DIR
    if create and not qdir.exists():
        os.mkdir(qdir, DIR_MODE)
        fsync_dir(str(root))
    quarantined = sum(1 for _ in os.scandir(qdir)) if qdir.exists() else 0

    now = time.time()
    found = _Found()
    with os.scandir(root) as level1:
        for d1 in level1:
            if not (_HEX2.match(d1.name) and d1.is_dir(follow_symlinks=False)):
                continue
            with os.scandir(d1.path) as level2:
                for d2 in level2:
                    if _HEX2.match(d2.name) and d2.is_dir(follow_symlinks=False):
                        _scan_leaf(d2.path, (d1.name, d2.name), found, now, stale_temp_s, create)
    entries, dirs, temps_removed = found.entries, found.dirs, found.temps_removed
    # Oldest first, so the OrderedDict built from it is in LRU order. atime is only as good as the
    # mount's atime policy (relatime updates it on the first read after a write), which is enough
    # to order a restart; the live order is kept in memory.
    entries.sort(key=lambda t: t[2])
    return ScanResult(entries, dirs, temps_removed, quarantined, created)


def temp_is_stale(entry: "os.DirEntry[str]", now: float, stale_temp_s: float) -> bool:
    m = _TEMP_NAME.match(entry.name)
    if m is not None and m.group(2) == HOST_TAG:
        pid = int(m.group(3))
        if pid != os.getpid() and not pid_alive(pid):
            return True  # its writer on this host is gone: the rename can never happen
    try:
        age = now - entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return False
    # Another host's writer (shared filesystem) or a live one: only an old file is surely abandoned.
    return age > stale_temp_s
