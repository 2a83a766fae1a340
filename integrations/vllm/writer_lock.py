"""One writer per vLLM ``cache_dir``: an exclusive ``flock`` on a lock file inside it.

Primitives: ``WRITER_LOCK_FILE`` (the lock file's name), ``take_writer_lock`` (the descriptor
holding the lock, with this pid written into the file; or, when another process holds it, that
holder's pid as text) and ``release_writer_lock``. Blocking but brief (a few system calls); a
``KvtierTier`` takes the lock in its constructor, before it opens the directory, and releases it in
``shutdown``, on the thread that calls them.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional, Union

__all__ = ["WRITER_LOCK_FILE", "take_writer_lock", "release_writer_lock"]

WRITER_LOCK_FILE = "vllm-writer.lock"


def take_writer_lock(cache_dir: str) -> Union[int, str]:
    """The descriptor holding ``cache_dir``'s writer lock (the directory made if missing), or the
    pid (as text, "unknown" when unreadable) of the process that holds it already."""
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    path = Path(cache_dir) / WRITER_LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def release_writer_lock(fd: Optional[int]) -> None:
    """Release the lock ``take_writer_lock`` gave (``None``: nothing held)."""
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock
