"""Where the file tier puts things: the on-disk layout of a root, and the small OS calls it relies on.

Layout (``root`` is 0700 and owned by the current user)::

    root/ab/cd/<hex key>.kvr                  one record (tiers.record format)
    root/ab/cd/.<hex key>.<host>-<pid>-<nonce>.tmp   a write in flight, or left by a crash
    root/quarantine/<hex key>.<nonce>.kvr     records that failed to decode, kept for inspection

``ab`` and ``cd`` are the first two bytes of ``xxh3_64(key)`` (``fanout``): two levels of 256
directories, so a million records leave about 15 entries per leaf directory, and keys that are not
uniformly distributed (tests, foreign producers) still spread evenly. Pure functions and constants;
any thread.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Tuple

import xxhash

__all__ = [
    "RECORD_SUFFIX",
    "TEMP_SUFFIX",
    "QUARANTINE_DIR",
    "DIR_MODE",
    "FILE_MODE",
    "HOST_TAG",
    "fanout",
    "private_opener",
    "fsync_dir",
]

RECORD_SUFFIX = ".kvr"
TEMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"

DIR_MODE = 0o700
FILE_MODE = 0o600
# Temp names carry it so that an open on this host can tell a dead writer's leftovers apart.
HOST_TAG = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


def fanout(key: bytes) -> Tuple[str, str]:
    """The two directory levels of ``key``'s record."""
    digest = xxhash.xxh3_64_digest(key)
    return f"{digest[0]:02x}", f"{digest[1]:02x}"


def private_opener(path: str, flags: int) -> int:
    """``open`` opener: 0600 from the start, a record must never be readable by others, not even
    for a moment."""
    return os.open(path, flags, FILE_MODE)


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (after a create or rename in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
