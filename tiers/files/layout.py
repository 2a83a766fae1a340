"""Where the file tier puts things: the on-disk layout of a root, and the small OS calls it relies on.

Layout (``root`` is 0700 and owned by the current user)::

    root/ab/cd/<hex key>.kvr                  one record (tiers.record_format)
    root/ab/cd/.<hex key>.<host>-<pid>-<nonce>.tmp   a write in flight, or left by a crash
    root/quarantine/<hex key>.<nonce>.kvr     records that failed to decode, kept for inspection

A key longer than 100 bytes (up to the contract's 511) does not fit one file name (NAME_MAX is 255):
its hex is cut into pieces of 200 digits, all but the last one directory levels named
``<piece>.k`` under ``ab/cd/``, the last one the file name (``key_location``). Temp names carry at
most 64 hex digits of the key (they are unique by their nonce; the digits are for humans), and a
quarantined long key is named by its first 64 hex digits and its XXH3-128.

``ab`` and ``cd`` are the first two bytes of ``xxh3_64(key)`` (``fanout``): two levels of 256
directories, so a million records leave about 15 entries per leaf directory, and keys that are not
uniformly distributed (tests, foreign producers) still spread evenly. Pure functions and constants;
any thread.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Optional, Tuple

import xxhash

__all__ = [
    "RECORD_SUFFIX",
    "TEMP_SUFFIX",
    "QUARANTINE_DIR",
    "DIR_MODE",
    "FILE_MODE",
    "HOST_TAG",
    "fanout",
    "key_location",
    "key_from_location",
    "temp_name",
    "quarantine_name",
    "CONTINUATION_SUFFIX",
    "private_opener",
    "fsync_dir",
]

RECORD_SUFFIX = ".kvr"
TEMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"

DIR_MODE = 0o700
FILE_MODE = 0o600
# Hex digits of a key per path component: a key of up to 100 bytes is one file name, as always.
NAME_HEX = 200
CONTINUATION_SUFFIX = ".k"
_TEMP_HEX = 64
# Temp names carry it so that an open on this host can tell a dead writer's leftovers apart.
HOST_TAG = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


def fanout(key: bytes) -> Tuple[str, str]:
    """The two directory levels of ``key``'s record."""
    digest = xxhash.xxh3_64_digest(key)
    return f"{digest[0]:02x}", f"{digest[1]:02x}"


def key_location(key: bytes) -> Tuple[Tuple[str, ...], str]:
    """(directory components under the root, file name without suffix) of ``key``'s record."""
    d1, d2 = fanout(key)
    digits = key.hex()
    pieces = [digits[i : i + NAME_HEX] for i in range(0, len(digits), NAME_HEX)]
    return (d1, d2) + tuple(piece + CONTINUATION_SUFFIX for piece in pieces[:-1]), pieces[-1]


def key_from_location(dirs: Tuple[str, ...], name: str) -> Optional[bytes]:
    """The key a record found at ``dirs`` / ``name`` (suffix removed) stands for, or ``None`` when
    that is not where ``key_location`` puts it (misplaced, or not ours): such a file is never
    served, because ``key_location`` would never find it."""
    digits = "".join(d[: -len(CONTINUATION_SUFFIX)] for d in dirs[2:]) + name
    try:
        key = bytes.fromhex(digits)
    except ValueError:
        return None
    if not key or key_location(key) != (dirs, name):
        return None
    return key


def temp_name(key: bytes, tag: str) -> str:
    """The name of a temp file for ``key`` (``tag``: host, pid, nonce and a counter)."""
    return f".{key.hex()[:_TEMP_HEX]}.{tag}{TEMP_SUFFIX}"


def quarantine_name(key: bytes, nonce: str) -> str:
    """The name a corrupt record of ``key`` gets under ``quarantine/``."""
    digits = key.hex()
    if len(digits) > _TEMP_HEX:
        digits = f"{digits[:_TEMP_HEX]}-{xxhash.xxh3_128_hexdigest(key)}"
    return f"{digits}.{nonce}{RECORD_SUFFIX}"


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
