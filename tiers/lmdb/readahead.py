"""Read-ahead for a batch of cold records: one ``madvise(MADV_WILLNEED)`` per record before any is
decoded, so the kernel reads the whole batch's pages concurrently instead of faulting them in 4 KiB
at a time as the decoder walks each record (measured: 1 MiB records read cold through the map at
~450-770 MB/s plainly, ~1.0-1.3 GB/s with the advice, on the same disk in the same run).

Primitive: ``advise_willneed(views)``; any thread; a no-op where the platform lacks ``madvise``.
The views must stay mapped (the caller's read transaction open) while the call runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Iterable, Optional

import numpy as np

__all__ = ["advise_willneed", "READAHEAD_MIN_BYTES"]

# Below this a record is a few pages that LMDB's own readahead covers; the syscall would cost more.
READAHEAD_MIN_BYTES = 64 << 10
_PAGE = mmap.PAGESIZE
_WILLNEED: Optional[int] = getattr(mmap, "MADV_WILLNEED", None)


def _load_madvise():
    if _WILLNEED is None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def advise_willneed(views: Iterable[memoryview]) -> None:
    """Start the kernel's read of every view's pages now (best effort: failures are ignored, the
    decoder then faults the pages in as before)."""
    if _madvise is None:
        return
    for view in views:
        size = view.nbytes
        if size < READAHEAD_MIN_BYTES:
            continue
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        start = address - address % _PAGE
        _madvise(start, address + size - start, _WILLNEED)
