"""Cache directories that only their owner can write.

Primitive: ``ensure_private_dir(path, create=True)``. Synchronous, any thread (call it off the event
loop: it touches the filesystem). A cache directory holds records that are decoded into memory a
model then attends to; another user who can write there could plant records, so kvtier creates it
0700 and refuses one that is world-writable or owned by someone else.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Union

from kvtier.errors import TierIOError, UnsafeDirectoryError

__all__ = ["ensure_private_dir", "check_private_file"]

PathLike = Union[str, "os.PathLike[str]"]


def _describe(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"


def ensure_private_dir(path: PathLike, *, create: bool = True, files: Iterable[str] = ()) -> Path:
    """Return the resolved directory, creating it with mode 0700 (parents with the default mode) when
    missing and ``create`` is true.

    Raises ``UnsafeDirectoryError`` when the directory (after following symlinks) is not a directory,
    is world-writable, or is not owned by the effective uid; likewise for any of ``files`` that exist
    inside it. Raises ``TierIOError`` when it is missing and ``create`` is false, or cannot be made.
    An existing directory's mode is left as it is (only world-writable is refused).
    """
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        if not create:
            raise TierIOError(f"cache directory {p} does not exist")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # another process made it first: fall through to the same checks
        except OSError as exc:
            raise TierIOError(f"cannot create cache directory {p}: {exc}") from exc
        else:
            # mkdir's mode is masked by the umask, which can only remove bits; set it exactly.
            os.chmod(p, 0o700)
    p = p.resolve()
    try:
        st = os.stat(p)
    except OSError as exc:
        raise TierIOError(f"cannot stat cache directory {p}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"cache path {p} is not a directory")
    _check(p, st, "cache directory")
    for name in files:
        check_private_file(p / name)
    return p


def check_private_file(path: Path) -> None:
    """Refuse an existing file (a database or lock file) that others could write or that we do not own."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TierIOError(f"cannot stat {path}: {exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeDirectoryError(f"{path} is not a regular file")
    _check(path, st, "cache file")


def _check(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
            f"kvtier refuses it ({_describe(st)})"
        )
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeDirectoryError(
            f"{what} {path} is world-writable ({_describe(st)}); run `chmod o-w {path}` or use another path"
        )
