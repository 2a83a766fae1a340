"""Real mounts for tests that need a full, read-only or mounted cache directory (root only; a test
that cannot mount is skipped with the reason)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, Sequence

import pytest

__all__ = ["mounted", "tmpfs", "bind_mount", "fill_up"]


@contextlib.contextmanager
def mounted(where: Path, args: Sequence[str]) -> Iterator[Path]:
    """``mount <args> <where>``, unmounted afterwards (lazily if busy)."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount; running as uid {os.geteuid()}")
    if shutil.which("mount") is None:
        pytest.skip("needs the mount command")
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False)


def tmpfs(where: Path, options: str):
    """A real tmpfs at ``where`` with mount ``options`` (``size=1m,ro``...)."""
    return mounted(where, ["-t", "tmpfs", "-o", options, "tmpfs"])


def bind_mount(source: Path, where: Path, *, read_only: bool = False):
    """``source`` bind-mounted at ``where``: ``where`` becomes a mount point (read-only: writes
    through ``where`` fail with EROFS, while ``source`` stays writable)."""
    return mounted(where, ["--bind", *(["-o", "ro"] if read_only else []), str(source)])


def fill_up(path: Path) -> None:
    """Write zeros into ``path`` until its filesystem is full (to the last byte)."""
    with open(path, "wb", buffering=0) as f:
        for size in (64 << 10, 4096, 512, 1):
            try:
                while True:
                    f.write(bytes(size))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
