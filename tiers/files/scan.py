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
from dataclasses import dataclass
from pathlib import Path
from typing import List, Set, Tuple

from kvtier.errors import UnsafeDirectoryError

from .layout import DIR_MODE, HOST_TAG, QUARANTINE_DIR, RECORD_SUFFIX, TEMP_SUFFIX, fanout, fsync_dir

__all__ = ["ScanResult", "scan_tree", "check_root_safe"]

_HEX2 = re.compile(r"^[0-9a-f]{2}$")
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
    dirs: Set[Tuple[str, str]]
    temps_removed: int
    quarantined_files: int
    created: bool


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
    entries: List[Tuple[bytes, int, float]] = []
    dirs: Set[Tuple[str, str]] = set()
    temps_removed = 0
    with os.scandir(root) as level1:
        for d1 in level1:
            if not (_HEX2.match(d1.name) and d1.is_dir(follow_symlinks=False)):
                continue
            with os.scandir(d1.path) as level2:
                for d2 in level2:
                    if not (_HEX2.match(d2.name) and d2.is_dir(follow_symlinks=False)):
                        continue
                    dirs.add((d1.name, d2.name))
                    with os.scandir(d2.path) as leaf:
                        for e in leaf:
                            name = e.name
                            if name.startswith(".") and name.endswith(TEMP_SUFFIX):
                                if create and temp_is_stale(e, now, stale_temp_s):
                                    try:
                                        os.unlink(e.path)
                                        temps_removed += 1
                                    except FileNotFoundError:
                                        pass  # its writer renamed or removed it meanwhile
                                continue
                            if not name.endswith(RECORD_SUFFIX):
                                continue  # not ours: leave it alone
                            try:
                                key = bytes.fromhex(name[: -len(RECORD_SUFFIX)])
                            except ValueError:
                                continue
                            if not key or fanout(key) != (d1.name, d2.name):
                                continue  # misplaced: path_for() would never find it
                            st = e.stat(follow_symlinks=False)
                            if not stat.S_ISREG(st.st_mode):
                                continue  # a symlink or device under our root is never served
                            entries.append((key, st.st_size, max(st.st_atime, st.st_mtime)))
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
