"""The CUDA runtime calls torch does not expose, from the ``libcudart`` this process already loaded.

Primitives: ``cuda_runtime()`` (the process's ``CudaRuntime`` or ``None``), ``CudaRuntime``
(``get_last_error``, ``stream_create``, ``stream_destroy``).

Why: torch's ``torch.cuda.cudart()`` binds ``cudaHostRegister`` but not ``cudaGetLastError``, so a
failed registration leaves its error pending on the thread and the next kernel launch reports it as
its own; and ``torch.cuda.Stream()`` hands out one of 32 pooled streams per device and priority,
round robin (``getStreamFromPool`` in c10/cuda/CUDAStream.cpp), shared with every other caller in
the process, so it cannot give a component a stream of its own. The library is found in
``/proc/self/maps`` (the one torch loaded: the same error state and context), else by soname.

Threads: CUDA's last-error state is per thread; call ``get_last_error`` on the thread that made the
failing call. Everything else is safe from any thread.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

__all__ = ["CudaRuntime", "cuda_runtime", "CUDA_STREAM_NON_BLOCKING"]

# cudaStreamNonBlocking: no implicit ordering with the legacy default stream, which is torch's
# default compute stream; a blocking stream would serialise every copy with the forward pass.
CUDA_STREAM_NON_BLOCKING = 1

_lock = threading.Lock()
_runtime: Optional["CudaRuntime"] = None
_looked_up = False


class CudaRuntime:
    """Thin ctypes bindings of the few runtime calls kvtier needs (see the module docstring).
    Any thread; ``get_last_error`` reports the calling thread's error only."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        lib.cudaStreamCreateWithPriority.restype = ctypes.c_int
        lib.cudaStreamCreateWithPriority.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
        lib.cudaStreamDestroy.restype = ctypes.c_int
        lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]

    def get_last_error(self) -> int:
        """Return and clear the error pending on the calling thread (0: none)."""
        return int(self._lib.cudaGetLastError())

    def stream_create(self, priority: int = 0) -> int:
        """A new non-blocking stream of the current device, owned by the caller; its handle."""
        handle = ctypes.c_void_p()
        code = int(self._lib.cudaStreamCreateWithPriority(ctypes.byref(handle), CUDA_STREAM_NON_BLOCKING, priority))
        if code != 0:
            self.get_last_error()
            raise OSError(f"cudaStreamCreateWithPriority failed with cudaError {code}")
        return int(handle.value or 0)

    def stream_destroy(self, handle: int) -> int:
        """Release a stream from ``stream_create``; work already queued on it still completes."""
        return int(self._lib.cudaStreamDestroy(ctypes.c_void_p(handle)))


def _loaded_cudart_path() -> Optional[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and "libcudart" in fields[-1].rsplit("/", 1)[-1]:
                    return fields[-1]
    except OSError:
        pass
    return None


def cuda_runtime() -> Optional[CudaRuntime]:
    """The process's CUDA runtime bindings, looked up once; ``None`` when no ``libcudart`` loads
    (a CPU-only torch, or a runtime linked statically)."""
    global _runtime, _looked_up
    with _lock:
        if not _looked_up:
            _looked_up = True
            for path in (_loaded_cudart_path(), "libcudart.so.12", "libcudart.so.13", "libcudart.so"):
                if path is None:
                    continue
                try:
                    _runtime = CudaRuntime(ctypes.CDLL(path), path)
                    break
                except (OSError, AttributeError):
                    continue
        return _runtime
