"""XXH3-128 over a record's parts without releasing the GIL: the read path's checksum.

Why: the ``xxhash`` package releases the GIL around every ``update``. In a serving process whose own
threads keep the GIL busy (a scheduler, a tokenizer), a reader thread that lets go of it for the
~50-200 us of hashing a 1-4 MiB payload gets it back only after the switch interval (5 ms) or two,
so every record read paid one more wait than its ``preadv``. Hashing through the xxHash C library
called by ``ctypes.PyDLL`` (which keeps the GIL) costs those microseconds on the reading thread and
no wait; the other readers are in their ``preadv`` meanwhile, the GIL released there.

Primitives: ``digest_parts(head, payload)`` (the canonical 16-byte XXH3-128 digest of ``head``
then ``payload``, as ``xxhash.xxh3_128`` would give), ``HELD`` (whether the C library was found;
without it ``digest_parts`` is the ``xxhash`` package's streaming digest, same bytes). Any thread:
each thread keeps its own hash state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import threading
from typing import Any, Optional

import numpy as np
import xxhash

__all__ = ["digest_parts", "HELD"]

# XXH3 output is stable from xxHash 0.8.0 on (its docs: "the XXH3 ... format is stable").
_MIN_VERSION = 800
_DIGEST = struct.Struct(">QQ")  # XXH128_canonicalFromHash: high64 then low64, big-endian


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _load() -> Optional[Any]:
    name = ctypes.util.find_library("xxhash")
    if name is None:
        return None
    try:
        lib = ctypes.PyDLL(name)  # PyDLL: the GIL stays held across the calls (the point)
        if lib.XXH_versionNumber() < _MIN_VERSION:
            return None
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_createState.argtypes = []
        lib.XXH3_128bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_128bits_reset.restype = ctypes.c_int
        lib.XXH3_128bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.XXH3_128bits_update.restype = ctypes.c_int
        lib.XXH3_128bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_128bits_digest.restype = _Hash128
    except (OSError, AttributeError):
        return None
    return lib


_LIB = _load()
HELD = _LIB is not None
_local = threading.local()


def _state() -> int:
    state = getattr(_local, "state", None)
    if state is None:
        assert _LIB is not None
        state = _LIB.XXH3_createState()  # one per thread, for the thread's life (a few hundred bytes)
        if not state:
            raise MemoryError("XXH3_createState failed")
        _local.state = state
    return state


def _address(view: memoryview) -> int:
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def digest_parts(head: bytes, payload: memoryview) -> bytes:
    """XXH3-128 of ``head`` followed by ``payload`` (C-contiguous bytes), canonical digest."""
    if _LIB is None:
        h = xxhash.xxh3_128(head)
        h.update(payload)
        return h.digest()
    state = _state()
    _LIB.XXH3_128bits_reset(state)
    _LIB.XXH3_128bits_update(state, head, len(head))
    n = payload.nbytes
    if n:
        _LIB.XXH3_128bits_update(state, _address(payload), n)
    d = _LIB.XXH3_128bits_digest(state)
    return _DIGEST.pack(d.high64, d.low64)
