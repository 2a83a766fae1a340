"""The device backend: every CUDA specific of kvtier in one place, and the completion of a copy batch.

Primitives:

- ``DeviceBackend``: host buffers pinned by ``cudaHostRegister``, copy streams of kvtier's own,
  completion events, stream ordering. On CPU the same methods are no-ops or plain allocations, so
  the host pool and the device view (``tiers.device``) run one code path on both.
- ``CopyHandle``: completion of one enqueued batch: ``done()`` polls, ``wait()`` blocks,
  ``wait_on_stream()`` orders a CUDA stream after the copy without blocking the host.
- ``register_host_range``: ``cudaHostRegister`` with the thread's CUDA error cleared on failure.

Threads: construction and ``host_buffer`` belong at start-up (``host_buffer`` pre-faults with the
GIL released, so an event loop on another thread keeps running); the stream and event methods run
on whichever thread enqueues copies (torch's current stream is per thread); ``release_host_buffer``
may run from a GC finalizer on any thread (a lock guards the registrations). ``CopyHandle.done()``
never blocks (event loop); ``wait()`` blocks in ``event.synchronize()`` (a worker thread).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Union

import torch

from kvtier.errors import DeviceError

__all__ = ["DeviceBackend", "CopyHandle", "register_host_range", "PAGE_BYTES", "DeviceLike"]

PAGE_BYTES = 4096
# cudaHostRegisterPortable: the pinned range counts as pinned for every CUDA context, so a pool made
# while another device is current still gets async copies.
_CUDA_HOST_REGISTER_PORTABLE = 1
# Pre-fault in 256 MiB pieces: each zero_() releases the GIL, so the event loop runs between them.
_FAULT_PIECE_BYTES = 256 << 20

DeviceLike = Union[str, torch.device]


class DeviceBackend:
    """Hides the cpu/cuda differences from the host pool and the device view.

    ``DeviceBackend("cpu")`` or ``DeviceBackend("cuda")`` / ``("cuda:1")``. Asking for CUDA where
    ``torch.cuda.is_available()`` is false raises ``DeviceError``; a device type other than cpu and
    cuda raises ``DeviceError`` too. Construction and ``host_buffer`` belong at start-up; the stream
    and event methods are cheap and run on whichever thread enqueues copies; ``is_pinned`` and
    ``release_host_buffer`` on any thread (module docstring).
    """

    def __init__(self, device: DeviceLike = "cpu") -> None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"not a device: {device!r}") from exc
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceError(
                    f"device {str(dev)!r} requested but torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}): no usable "
                    "GPU or driver is visible to this process; use device 'cpu' or fix the GPU "
                    "setup"
                )
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            elif dev.index >= torch.cuda.device_count():
                raise DeviceError(
                    f"device {str(dev)!r} requested but only {torch.cuda.device_count()} CUDA "
                    "device(s) are visible (check CUDA_VISIBLE_DEVICES)"
                )
        elif dev.type != "cpu":
            raise DeviceError(
                f"unsupported device {str(dev)!r}: kvtier copies between host memory and 'cpu' or "
                "'cuda' tensors only"
            )
        self.device: torch.device = dev
        self.is_cuda: bool = dev.type == "cuda"
        # data_ptr of each buffer handed out -> registered base pointer, for release_host_buffer.
        self._registered: Dict[int, int] = {}
        self._own_streams: List[int] = []
        self._lock = threading.Lock()  # release may run from a GC finalizer on another thread

    def device_uuid(self) -> Optional[str]:
        """The GPU's UUID as NVML names it (``"GPU-..."``); ``None`` on CPU. NVML numbers GPUs
        without ``CUDA_VISIBLE_DEVICES``, so torch's index may name another GPU there."""
        if not self.is_cuda:
            return None
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"

    def reusable_device_bytes(self) -> int:
        """Bytes torch's caching allocator holds on this device but has not handed out (staging
        can reuse them); 0 on CPU."""
        if not self.is_cuda:
            return 0
        return int(torch.cuda.memory_reserved(self.device)) - int(torch.cuda.memory_allocated(self.device))

    @property
    def copy_workers(self) -> int:
        """Copy threads the engine gives each direction. CUDA: 2, so batch n+1 is queued on the
        copy stream while batch n's thread waits on its event (the stream keeps their order). CPU:
        1, a copy runs in its thread's ``copy_`` and a second thread would only share the cores."""
        return 2 if self.is_cuda else 1

    @property
    def kind(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self.device.type

    def __repr__(self) -> str:
        return f"DeviceBackend({str(self.device)!r})"

    # -- host memory ---------------------------------------------------------------------------

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A page-aligned, pre-faulted ``uint8`` host tensor of ``nbytes``; page-locked on CUDA.

        Pinning registers a plain allocation (``cudaHostRegister``) instead of ``pin_memory=True``:
        torch's caching host allocator rounds each request up to a power of two, which for a
        multi-GiB slab can waste almost half of it. Every page is written once here (first-touch
        costs ~1 GB/s on these machines) so no page fault lands on the copy path; the writing goes
        in pieces of ``_FAULT_PIECE_BYTES`` with the GIL released, so an event loop on another
        thread keeps running. A failed registration clears its CUDA error and raises
        ``DeviceError``: a CUDA copy path on pageable memory would be 5-20x slower, silently.
        Pair with ``release_host_buffer``.
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        # Page alignment keeps slot boundaries page-aligned when slots are page multiples (direct
        # I/O and DMA both prefer it); the slack is one page.
        offset = (-raw.data_ptr()) % PAGE_BYTES
        buffer = raw[offset : offset + nbytes]
        for start in range(0, nbytes, _FAULT_PIECE_BYTES):
            buffer[start : start + _FAULT_PIECE_BYTES].zero_()  # pre-fault, off the hot path
        if self.is_cuda:
            from .cuda_runtime import cuda_runtime

            base = buffer.data_ptr()
            with torch.cuda.device(self.device):  # no context made on another GPU from a worker thread
                register_host_range(torch.cuda.cudart(), cuda_runtime(), base, nbytes)
            with self._lock:
                self._registered[base] = base
        return buffer

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` (from ``host_buffer``) is page-locked for this backend's copies."""
        with self._lock:
            return buffer.data_ptr() in self._registered

    def release_host_buffer(self, buffer: torch.Tensor) -> None:
        """Unpin a buffer from ``host_buffer`` (no-op on CPU and when already released). Views of it
        stay valid plain memory; only the page lock goes."""
        with self._lock:
            base = self._registered.pop(buffer.data_ptr(), None)
        if base is not None:
            code = int(torch.cuda.cudart().cudaHostUnregister(base))
            if code != 0:
                raise DeviceError(f"cudaHostUnregister failed with cudaError {code}")

    # -- streams and events --------------------------------------------------------------------

    def new_stream(self, priority: int = 0) -> Any:
        """A copy stream of kvtier's own (CUDA), ``None`` on CPU.

        ``torch.cuda.Stream()`` would hand out one of torch's 32 pooled streams per priority,
        round robin, which any other component of the process may be given too; so the stream is
        created with ``cudaStreamCreateWithPriority`` (non-blocking: no implicit ordering with the
        legacy default stream) and wrapped in ``torch.cuda.ExternalStream``. It lives as long as
        the backend. Without a loadable ``libcudart`` the pooled stream is the fallback."""
        if not self.is_cuda:
            return None
        from .cuda_runtime import cuda_runtime

        runtime = cuda_runtime()
        if runtime is None:
            return torch.cuda.Stream(device=self.device, priority=priority)
        with torch.cuda.device(self.device):
            handle = runtime.stream_create(priority)
        self._own_streams.append(handle)
        weakref.finalize(self, runtime.stream_destroy, handle)
        return torch.cuda.ExternalStream(handle, device=self.device)

    def current_stream(self) -> Any:
        """The calling thread's current (compute) stream on this device; ``None`` on CPU."""
        if not self.is_cuda:
            return None
        return torch.cuda.current_stream(self.device)

    def stream_scope(self, stream: Any) -> ContextManager[Any]:
        """Context in which copies are enqueued on ``stream`` (and its device is current)."""
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Any:
        """An event recorded on ``stream`` after the work queued so far; ``None`` on CPU (done)."""
        if stream is None:
            return None
        # blocking=True: event.synchronize() yields the CPU instead of spinning; the waiter is a
        # worker thread on a host with few cores, where a spinning waiter starves the event loop.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def ready_event(self, compute_stream: Any = None, ready_event: Any = None) -> Any:
        """The point after which copies may touch the KV blocks, taken now: ``ready_event`` when
        given, else an event recorded on ``compute_stream`` (default: the calling thread's current
        stream). Copies queued later wait for this event only, not for later compute."""
        if ready_event is not None:
            return ready_event
        return self.record_event(compute_stream if compute_stream is not None else self.current_stream())

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make work queued on ``stream`` from now on wait (on the GPU, host not blocked) for
        ``event``; a no-op on CPU, where copies run inline and are ordered by the caller."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    def event_done(self, event: Any) -> bool:
        """Whether the work before ``event`` completed (never blocks)."""
        return event is None or bool(event.query())

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until the work before ``event`` completed."""
        if event is not None:
            event.synchronize()

    def keep_alive_on(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell torch's caching allocator that ``stream`` uses ``tensor`` (``record_stream``), so
        memory the serving process frees while a copy is queued is not handed out again before the
        copy ends. Memory outside the caching allocator is not covered: fence first (module
        docstring)."""
        if stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)

    def index_tensor(self, values: List[int], device: torch.device, keep: List[torch.Tensor]) -> torch.Tensor:
        """``values`` as an int64 index on ``device``. On CUDA it is moved from pinned memory,
        queued on the current stream without blocking the host (the pinned source joins ``keep``:
        it must outlive the copy)."""
        host = torch.tensor(values, dtype=torch.int64)
        if device.type != "cuda":
            return host
        host = host.pin_memory()
        keep.append(host)
        return host.to(device, non_blocking=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One bulk copy between host and device (or staging) memory, asynchronous on CUDA."""
        dst.copy_(src, non_blocking=self.non_blocking)

    @property
    def host_fast_path(self) -> bool:
        """Whether CPU views copy with numpy inline (no streams, events or staging)."""
        return not self.is_cuda

    @property
    def non_blocking(self) -> bool:
        """Whether copies may be asynchronous (CUDA with pinned host memory)."""
        return self.is_cuda


def register_host_range(cudart: Any, runtime: Any, base: int, nbytes: int) -> None:
    """``cudaHostRegister`` a range (portable); on failure clear the thread's pending CUDA error
    (else the next kernel launch reports it as its own) and raise ``DeviceError``."""
    code = int(cudart.cudaHostRegister(base, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if code == 0:
        return
    cleared = "cleared" if runtime is not None and runtime.get_last_error() == code else "could not be cleared"
    raise DeviceError(
        f"cudaHostRegister of {nbytes} bytes failed with cudaError {code} (error {cleared}): the host "
        "pool cannot be page-locked, and CUDA copies from pageable memory are synchronous and 5-20x "
        "slower; raise the locked-memory limit (`ulimit -l`) or give the pool less host memory"
    )


class CopyHandle:
    """Completion of one batch of copies enqueued by ``DeviceKVView``.

    Keeps the tensors of the batch alive until the copy is known complete. On CPU it is done at
    creation. ``done()`` never blocks (event loop); ``wait()`` blocks until the copies finished (a
    worker thread); ``wait_on_stream(stream)`` makes a CUDA stream (default: the calling thread's
    current stream) wait for the copies without blocking the host: the serving process calls it
    after a load so its forward pass reads the restored blocks. Any thread: ``done()`` on the event
    loop, ``wait()`` on a worker thread.
    """

    __slots__ = ("_event", "_keepalive", "_backend")

    def __init__(
        self,
        backend: DeviceBackend,
        event: Any,
        keepalive: Sequence[torch.Tensor] = (),
    ) -> None:
        self._backend = backend
        self._event = event
        self._keepalive: Optional[Sequence[torch.Tensor]] = keepalive if event is not None else None

    def done(self) -> bool:
        if self._event is None:
            return True
        if self._backend.event_done(self._event):
            self._keepalive = None
            return True
        return False

    def wait(self) -> None:
        if self._event is not None:
            self._backend.synchronize(self._event)
            self._keepalive = None

    def wait_on_stream(self, stream: Any = None) -> None:
        if self._event is None:
            return
        if stream is None:
            stream = self._backend.current_stream()
        self._backend.wait_event(stream, self._event)

    def __repr__(self) -> str:
        return f"CopyHandle(done={self.done()})"
