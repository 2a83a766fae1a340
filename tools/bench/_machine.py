"""Probes of the machine the bench runs on: filesystem, page-cache drops, first-touch memory."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

__all__ = ["filesystem_of", "drop_caches_possible", "drop_page_cache", "prefault"]


def filesystem_of(path: Path) -> Dict[str, str]:
    """(mount point, fs type, device) of the mount holding ``path``, from /proc/mounts."""
    real = os.path.realpath(path)
    best = ("", "unknown", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                device, mount, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
                    best = (mount, fstype, device)
    except OSError:
        pass
    return {"mount": best[0], "type": best[1], "device": best[2]}


def drop_caches_possible() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def files_under(paths: Sequence[Path]) -> List[Path]:
    out: List[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            for root, _dirs, files in os.walk(p):
                out.extend(Path(root) / f for f in files)
        elif p.exists():
            out.append(p)
    return out


def drop_page_cache(paths: Sequence[Path]) -> bool:
    """Evict ``paths`` (files, or every file under a directory) from the page cache: sync, then
    ``POSIX_FADV_DONTNEED`` per file (mapped pages stay: close LMDB first), then, where permitted
    (root), ``echo 1 > /proc/sys/vm/drop_caches``. Returns whether the global drop happened."""
    for path in files_under(paths):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    if not drop_caches_possible():
        return False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def prefault(nbytes: int) -> float:
    """Touch and free ``nbytes`` of fresh memory; returns the first-touch speed in GB/s."""
    if nbytes <= 0:
        return 0.0
    started = time.perf_counter()
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.fill_(1)
    elapsed = time.perf_counter() - started
    del block
    gc.collect()
    return nbytes / elapsed / 1e9
