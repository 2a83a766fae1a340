"""XXH3-128 over several buffers in calls that keep the GIL.

``xxhash``'s Python functions release the GIL for any buffer of more than a few KiB. In a serving
process other threads (a scheduler, a tokenizer) hold the GIL up to the 5 ms switch interval at a
time, and every return from such a call waits for it: beside two CPU-bound threads, checksumming a
64 MiB batch of 1 MiB records (a handful of calls each) took 120-640 ms instead of 1.5 ms, which
bounded every disk write and every checked read to a few hundred MB/s. Holding the GIL through a
hash costs nothing the other threads would miss (XXH3 hashes a 1 MiB record in ~25 us, far under the
switch interval), so this module calls the same XXH3 code (the functions python-xxhash's extension
exports, its runtime CPU dispatch included) through ``ctypes.PyDLL``, whose calls never release it.

``xxh3_128_digest(*parts)`` is the canonical 16-byte XXH3-128 digest of the parts one after another
(equal to ``xxhash.xxh3_128`` fed each part), for ``bytes`` and any C-contiguous buffer. If the
symbols are missing (an extension built another way) or a self-check against ``xxhash`` disagrees
at import, it falls back to ``xxhash`` itself and ``HOLDS_GIL`` is False. Safe on any thread: each
thread hashes with a state of its own, freed when the thread ends.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
from typing import Callable, Optional, Union

import numpy as np
import xxhash

__all__ = ["xxh3_128_digest", "HOLDS_GIL"]

log = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


class _Functions:
    """The extension's streaming XXH3-128 functions, bound through ``ctypes.PyDLL``."""

    def __init__(self, library: ctypes.PyDLL) -> None:
        self.create = library.XXH3_createState
        self.create.restype, self.create.argtypes = ctypes.c_void_p, []
        self.free = library.XXH3_freeState
        self.free.restype, self.free.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self.reset = library.XXH3_128bits_reset
        self.reset.restype, self.reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
        # The dispatching update picks the widest SIMD the CPU has, as xxhash's own functions do.
        self.update = getattr(library, "XXH3_128bits_update_dispatch", None) or library.XXH3_128bits_update
        self.update.restype = ctypes.c_int
        self.update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.digest = library.XXH3_128bits_digest
        self.digest.restype, self.digest.argtypes = _Hash128, [ctypes.c_void_p]


class _State:
    """One thread's XXH3 state: allocated on its first hash, freed with the thread's locals."""

    def __init__(self, functions: _Functions) -> None:
        self._functions = functions
        self.address = functions.create()
        if not self.address:
            raise MemoryError("XXH3_createState failed")

    def __del__(self) -> None:
        if self.address:
            self._functions.free(self.address)
            self.address = None


class _HeldHasher:
    def __init__(self, functions: _Functions) -> None:
        self._functions = functions
        self._local = threading.local()

    def __call__(self, *parts: Buffer) -> bytes:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _State(self._functions)
        functions = self._functions
        functions.reset(state.address)
        for part in parts:
            if isinstance(part, bytes):
                if part:
                    functions.update(state.address, part, len(part))
                continue
            array = np.frombuffer(part, dtype=np.uint8)  # any C-contiguous buffer, read-only too
            if array.nbytes:
                functions.update(state.address, array.ctypes.data, array.nbytes)
        value = functions.digest(state.address)
        return value.high64.to_bytes(8, "big") + value.low64.to_bytes(8, "big")


def _released_digest(*parts: Buffer) -> bytes:
    state = xxhash.xxh3_128()
    for part in parts:
        state.update(part)
    return state.digest()


def _self_check(hasher: Callable[..., bytes]) -> bool:
    """Agreement with ``xxhash`` over parts that cross its internal buffer and stripe sizes."""
    data = bytes(range(256)) * 40
    views = (data[:3], memoryview(data)[3:300], bytearray(data[300:1500]), b"", memoryview(data[1500:]))
    return hasher(*views) == _released_digest(*views) and hasher() == _released_digest()


def _bind() -> Optional[_HeldHasher]:
    try:
        extension = importlib.import_module("xxhash._xxhash")
        hasher = _HeldHasher(_Functions(ctypes.PyDLL(extension.__file__)))
        if _self_check(hasher):
            return hasher
        log.warning("xxhash's extension disagreed with xxhash in a self-check; hashing through xxhash")
    except (ImportError, OSError, AttributeError) as exc:
        log.debug("XXH3 functions not bound from xxhash's extension (%s); hashing through xxhash", exc)
    return None


_held = _bind()
HOLDS_GIL = _held is not None
xxh3_128_digest: Callable[..., bytes] = _held if _held is not None else _released_digest
