"""The device side: a small cpu/cuda backend and the view of the serving process's paged KV tensors.

Primitives:

- ``DeviceBackend``: every CUDA specific of kvtier in one place (host buffers pinned by
  ``cudaHostRegister``, copy streams, completion events, stream ordering). On CPU the same methods
  are no-ops or plain allocations, so the host pool and the device view run one code path on both.
- ``DeviceKVView``: per group, the layer tensors whose first dimension is the device block index.
  ``gather``/``gather_many`` copy a chunk's blocks (all layers, layer-major) into host ``uint8``
  slots; ``scatter``/``scatter_many`` copy host slots into device blocks (``None`` skips a block).
  They return a ``CopyHandle`` as soon as the copies are queued. ``gather_many_groups`` /
  ``scatter_many_groups`` take items of several groups and by default block until done. On CUDA a
  batch waits for a ready event (the caller's, or one recorded on the compute stream when called),
  then per layer one ``index_select`` / ``index_copy_`` over the batch into device staging and one
  host copy per chunk, on the view's own copy stream; a batch failing partway waits for what it
  queued before raising. ``tools/testing/device.RecordingBackend`` runs that path on CPU.
- ``CopyHandle``: completion of one enqueued batch: ``done()`` polls, ``wait()`` blocks,
  ``wait_on_stream()`` orders a CUDA stream after the copy without blocking the host.

Threads: the view holds no mutable Python state, and torch's current-stream context is per thread,
so calls may come from any thread. The intended use is the engine's: one copy thread per direction
(device->host, host->device; two on CUDA, so one batch queues while another's thread waits on its
event), each call validating its whole batch and then queueing it. Two threads
queueing in the same direction share that direction's stream: still correct, but each batch's event
then also waits for the other's copies. On CUDA the queueing returns at once; ``CopyHandle.wait()``
(and the blocking ``*_many_groups``) block their thread in ``event.synchronize()``, so they belong
on a worker thread; ``done()`` is cheap and safe on the event loop. On CPU the copies run inline on
the calling thread and every handle is already done.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from dataclasses import dataclass
from math import prod
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from kvtier.errors import DeviceError
from kvtier.policy import ModelLayout

__all__ = ["DeviceBackend", "DeviceKVView", "CopyHandle"]

_PAGE_BYTES = 4096
# cudaHostRegisterPortable: the pinned range counts as pinned for every CUDA context, so a pool made
# while another device is current still gets async copies.
_CUDA_HOST_REGISTER_PORTABLE = 1
# Pre-fault in 256 MiB pieces: each zero_() releases the GIL, so the event loop runs between them.
_FAULT_PIECE_BYTES = 256 << 20
# Device staging per window of a batch: chunks are gathered per layer into it and moved in one copy
# per chunk. 64 MiB bounds what a batch borrows from the serving process's device memory.
STAGING_MAX_BYTES = 64 << 20

DeviceLike = Union[str, torch.device]
# Integer dtypes by element size: CPU copies move bits, whatever float format the KV cache uses.
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeviceBackend:
    """Hides the cpu/cuda differences from the host pool and the device view.

    ``DeviceBackend("cpu")`` or ``DeviceBackend("cuda")`` / ``("cuda:1")``. Asking for CUDA where
    ``torch.cuda.is_available()`` is false raises ``DeviceError``; a device type other than cpu and
    cuda raises ``DeviceError`` too. Construction and ``host_buffer`` belong at start-up; the stream
    and event methods are cheap and run on whichever thread enqueues copies.
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
        raw = torch.empty(nbytes + _PAGE_BYTES, dtype=torch.uint8)
        # Page alignment keeps slot boundaries page-aligned when slots are page multiples (direct
        # I/O and DMA both prefer it); the slack is one page.
        offset = (-raw.data_ptr()) % _PAGE_BYTES
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
    after a load so its forward pass reads the restored blocks.
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


@dataclass(frozen=True)
class _GroupTensors:
    layers: Tuple[torch.Tensor, ...]
    dtype: torch.dtype
    block_shape: Tuple[int, ...]
    num_blocks: int
    blocks_per_chunk: int
    block_nbytes: int  # bytes of one block of one layer

    @property
    def chunk_shape(self) -> Tuple[int, ...]:
        return (len(self.layers), self.blocks_per_chunk, *self.block_shape)

    @property
    def chunk_nbytes(self) -> int:
        return len(self.layers) * self.blocks_per_chunk * self.block_nbytes


# (position in the chunk, first device block, number of consecutive blocks)
_Run = Tuple[int, int, int]

GatherItem = Tuple[Sequence[int], torch.Tensor]  # (block_ids, out)
ScatterItem = Tuple[torch.Tensor, Sequence[Optional[int]]]  # (src, block_ids)
GroupGatherItem = Tuple[int, Sequence[int], torch.Tensor]  # (group_index, block_ids, out)
# (group_index, src, block_ids)
GroupScatterItem = Tuple[int, torch.Tensor, Sequence[Optional[int]]]
# (group, runs, host slot seen as the chunk's dtype and shape, the caller's host tensor)
_Plan = Tuple[_GroupTensors, List[_Run], torch.Tensor, torch.Tensor]
# CPU fast path: (group index, runs, host slot as a numpy array of the chunk's shape)
_CpuPlan = Tuple[int, List[_Run], np.ndarray]


class DeviceKVView:
    """The serving process's paged KV cache, seen as chunks.

    ``kv_caches[g]`` is the list of layer tensors of group ``g`` of ``layout``; each has the device
    block index as its first dimension and, within a group, the same per-block shape, dtype, block
    count and device (strides may differ: a permuted K/V tensor copies correctly, just in more
    pieces). A chunk of group ``g`` is ``layout.groups[g].blocks_per_chunk`` blocks; its host form
    is ``chunk_nbytes(g)`` bytes laid out as ``chunk_shape(g) = (num_layers, blocks_per_chunk,
    *block_shape)`` in the group's dtype (layer-major, so one layer's blocks are contiguous).

    All tensors must live on one cpu or cuda device. Errors (``DeviceError``) name the group, and
    the layer or block at fault. See the module docstring for threads; ``compute_stream`` arguments
    default to the calling thread's current stream.
    """

    def __init__(
        self,
        layout: ModelLayout,
        kv_caches: Sequence[Sequence[torch.Tensor]],
        *,
        backend: Optional[DeviceBackend] = None,
    ) -> None:
        if not isinstance(layout, ModelLayout):
            raise TypeError(f"layout must be a ModelLayout, got {type(layout).__name__}")
        if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
            raise DeviceError(
                "kv_caches must be a sequence (one entry per group) of sequences of layer tensors, "
                f"got {type(kv_caches).__name__}"
            )
        if len(kv_caches) != len(layout.groups):
            raise DeviceError(
                f"kv_caches has {len(kv_caches)} group(s) but the layout has {len(layout.groups)}"
            )
        groups: List[_GroupTensors] = []
        device: Optional[torch.device] = None
        for gi, (spec, layers) in enumerate(zip(layout.groups, kv_caches)):
            group = self._validate_group(gi, spec.blocks_per_chunk, layers, spec.block_size)
            group_device = group.layers[0].device
            if device is None:
                device = group_device
            elif group_device != device:
                raise DeviceError(
                    f"group {gi}, layer 0: tensor on {group_device} but group 0 is on {device}; "
                    "one view serves one device"
                )
            groups.append(group)
        assert device is not None  # layout.groups is never empty (ModelLayout checks)
        self.layout = layout
        if backend is None:
            backend = DeviceBackend(device)
        elif not isinstance(backend, DeviceBackend) or backend.device.type != device.type:
            raise DeviceError(f"backend {backend!r} does not serve the KV tensors' device {device}")
        self.backend = backend
        self._groups: Tuple[_GroupTensors, ...] = tuple(groups)
        self._group_index = {id(group): gi for gi, group in enumerate(groups)}
        # One stream of kvtier's own per direction, so stores (d2h) and loads (h2d) overlap each
        # other and compute; loads get the higher priority (a forward pass waits for them).
        self._d2h_stream = backend.new_stream(priority=0)
        self._h2d_stream = backend.new_stream(priority=-1)
        # CPU: numpy views of every layer (made once), so a copy costs ~1 us of Python instead of
        # the ~10 us of torch indexing and dispatch per layer; at 256 KiB chunks that overhead was
        # as large as the copy itself. None on CUDA (streams, events and staging need torch).
        self._np_layers = self._numpy_layers() if backend.host_fast_path else None
        # Per group, the layers seen as same-size integers: staging moves bits, whatever the dtype
        # (index_select has no kernel for some float8 formats on some builds).
        self._bit_layers = tuple(
            tuple(layer.detach().view(_BITS_DTYPES[g.layers[0].element_size()]) for layer in g.layers)
            for g in self._groups
        )

    @staticmethod
    def _validate_group(
        gi: int, blocks_per_chunk: int, layers: Sequence[torch.Tensor], block_size: int = 0
    ) -> _GroupTensors:
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise DeviceError(
                f"group {gi}: expected a sequence of layer tensors, got {type(layers).__name__}"
            )
        if len(layers) == 0:
            raise DeviceError(f"group {gi}: no layer tensors")
        first = layers[0]
        for li, layer in enumerate(layers):
            if not isinstance(layer, torch.Tensor):
                raise DeviceError(f"group {gi}, layer {li}: not a tensor ({type(layer).__name__})")
            if layer.dim() < 2:
                raise DeviceError(
                    f"group {gi}, layer {li}: shape {tuple(layer.shape)} has no per-block "
                    "dimensions (expected [num_blocks, *block_shape])"
                )
            if li == 0:
                continue
            if layer.dtype != first.dtype:
                raise DeviceError(
                    f"group {gi}, layer {li}: dtype {layer.dtype} differs from layer 0's "
                    f"{first.dtype}"
                )
            if tuple(layer.shape[1:]) != tuple(first.shape[1:]):
                raise DeviceError(
                    f"group {gi}, layer {li}: per-block shape {tuple(layer.shape[1:])} differs "
                    f"from layer 0's {tuple(first.shape[1:])}"
                )
            if layer.shape[0] != first.shape[0]:
                raise DeviceError(
                    f"group {gi}, layer {li}: {layer.shape[0]} blocks but layer 0 has "
                    f"{first.shape[0]}"
                )
            if layer.device != first.device:
                raise DeviceError(
                    f"group {gi}, layer {li}: on {layer.device} but layer 0 is on {first.device}"
                )
        # bool and complex tensors are not a KV cache: their bytes would be stored and restored
        # faithfully, but only because something upstream handed kvtier the wrong tensor.
        if first.dtype == torch.bool or first.dtype.is_complex:
            raise DeviceError(f"group {gi}, layer 0: dtype {first.dtype} is not a KV-cache dtype")
        if first.shape[0] < blocks_per_chunk:
            raise DeviceError(
                f"group {gi}, layer 0: {first.shape[0]} blocks in the first (block index) dimension, "
                f"fewer than one chunk ({blocks_per_chunk} blocks); is the block index the first dimension?"
            )
        shape = tuple(first.shape)
        if len(shape) >= 3 and shape[0] == 2 and shape[1] > 2 and shape[2] == block_size:
            # vLLM's FlashAttention layout, [2 (K, V), num_blocks, block_size, ...]: read as 2 blocks of
            # [num_blocks, block_size, ...] every copy would move whole caches' halves.
            raise DeviceError(
                f"group {gi}, layer 0: shape {shape} has K and V first ([2, num_blocks, block_size, ...]); "
                "the block index must be the first dimension: pass layer[0] and layer[1] as two layers"
            )
        block_shape = tuple(int(d) for d in first.shape[1:])
        block_nbytes = prod(block_shape) * first.element_size()
        if block_nbytes == 0:
            raise DeviceError(f"group {gi}, layer 0: per-block shape {block_shape} holds no bytes")
        return _GroupTensors(
            layers=tuple(layers),
            dtype=first.dtype,
            block_shape=block_shape,
            num_blocks=int(first.shape[0]),
            blocks_per_chunk=blocks_per_chunk,
            block_nbytes=block_nbytes,
        )

    def _numpy_layers(self) -> Optional[Tuple[Tuple[np.ndarray, ...], ...]]:
        """Per group, each layer tensor seen as a numpy array of same-size integers (bit copies);
        ``None`` when torch will not hand one out (a tensor that requires grad, an odd dtype)."""
        out = []
        for group in self._groups:
            bits = _BITS_DTYPES.get(group.layers[0].element_size())
            if bits is None:
                return None
            try:
                out.append(tuple(layer.detach().view(bits).numpy() for layer in group.layers))
            except (RuntimeError, TypeError):
                return None
        return tuple(out)

    # -- geometry ------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def _group(self, group_index: int) -> _GroupTensors:
        if (
            not isinstance(group_index, int)
            or isinstance(group_index, bool)
            or not 0 <= group_index < len(self._groups)
        ):
            raise DeviceError(
                f"group index {group_index!r} out of range [0, {len(self._groups)})"
            )
        return self._groups[group_index]

    def chunk_nbytes(self, group_index: int) -> int:
        """Bytes of one chunk of the group: ``num_layers * blocks_per_chunk * block bytes``."""
        return self._group(group_index).chunk_nbytes

    def chunk_dtype(self, group_index: int) -> torch.dtype:
        return self._group(group_index).dtype

    def chunk_shape(self, group_index: int) -> Tuple[int, ...]:
        """``(num_layers, blocks_per_chunk, *block_shape)``: logical shape of a chunk's bytes."""
        return self._group(group_index).chunk_shape

    def num_blocks(self, group_index: int) -> int:
        """Device blocks in each layer tensor of the group."""
        return self._group(group_index).num_blocks

    def num_layers(self, group_index: int) -> int:
        return len(self._group(group_index).layers)

    def device_index(self) -> Optional[int]:
        """The CUDA device index the KV tensors live on (for NVML); ``None`` on CPU."""
        return self.device.index if self.backend.is_cuda else None

    @property
    def staging_nbytes(self) -> int:
        """Device bytes one direction's batch borrows for staging, at most (a window of the group
        with the largest chunks, per-layer and per-chunk buffers); 0 on the CPU fast path."""
        if self._np_layers is not None:
            return 0
        return max(2 * max(1, STAGING_MAX_BYTES // (2 * g.chunk_nbytes)) * g.chunk_nbytes for g in self._groups)

    # -- validation ----------------------------------------------------------------------------

    def _runs(
        self,
        gi: int,
        group: _GroupTensors,
        block_ids: Sequence[Optional[int]],
        allow_none: bool,
        seen: Dict[int, int],
    ) -> List[_Run]:
        """Validate one chunk's block ids and coalesce consecutive ones into runs (one copy per run
        per layer instead of one per block: block tables are often consecutive)."""
        if isinstance(block_ids, (str, bytes, torch.Tensor)) or not isinstance(block_ids, Sequence):
            raise DeviceError(
                f"group {gi}: block ids must be a sequence of ints, got {type(block_ids).__name__}"
            )
        if len(block_ids) != group.blocks_per_chunk:
            raise DeviceError(
                f"group {gi}: a chunk has {group.blocks_per_chunk} block(s), got "
                f"{len(block_ids)} block id(s)"
            )
        runs: List[_Run] = []
        for pos, raw in enumerate(block_ids):
            if raw is None:
                if not allow_none:
                    raise DeviceError(
                        f"group {gi}: block_ids[{pos}] is None; gather needs every block"
                    )
                continue
            try:
                if isinstance(raw, bool):
                    raise TypeError
                block = operator.index(raw)
            except TypeError:
                raise DeviceError(
                    f"group {gi}: block_ids[{pos}] = {raw!r} is not an int"
                ) from None
            if not 0 <= block < group.num_blocks:
                raise DeviceError(
                    f"group {gi}: block id {block} (block_ids[{pos}]) out of range "
                    f"[0, {group.num_blocks})"
                )
            if block in seen:
                raise DeviceError(
                    f"group {gi}: block id {block} (block_ids[{pos}]) appears twice in one "
                    "chunk or batch"
                )
            seen[block] = pos
            if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == block:
                start_pos, start_block, length = runs[-1]
                runs[-1] = (start_pos, start_block, length + 1)
            else:
                runs.append((pos, block, 1))
        return runs

    def _host_array(self, gi: int, group: _GroupTensors, slot: torch.Tensor, what: str) -> np.ndarray:
        """CPU fast path: the host slot as a numpy array of the chunk's shape, in same-size integers
        (a view, no copy). Checks exactly what ``_typed_slot`` checks, with the same errors."""
        self._check_slot_tensor(gi, group, slot, what)
        bits = self._np_layers[gi][0].dtype  # type: ignore[index]
        if slot.data_ptr() % bits.itemsize:
            raise DeviceError(f"group {gi}: {what} cannot be viewed as {group.dtype} (misaligned start?)")
        # uint8 tensors never require grad, so numpy() always hands out the view.
        return slot.numpy().reshape(-1).view(bits).reshape(group.chunk_shape)

    def _typed_slot(
        self, gi: int, group: _GroupTensors, slot: torch.Tensor, what: str
    ) -> torch.Tensor:
        """The host slot seen as the chunk's dtype and shape (a view, no copy)."""
        self._check_slot_tensor(gi, group, slot, what)
        try:
            return slot.reshape(-1).view(group.dtype).view(group.chunk_shape)
        except RuntimeError as exc:
            # A byte view as a wider dtype needs the start aligned to the element size.
            raise DeviceError(
                f"group {gi}: {what} cannot be viewed as {group.dtype} (misaligned start?)"
            ) from exc

    def _check_slot_tensor(self, gi: int, group: _GroupTensors, slot: torch.Tensor, what: str) -> None:
        if not isinstance(slot, torch.Tensor):
            raise DeviceError(f"group {gi}: {what} must be a tensor, got {type(slot).__name__}")
        if slot.dtype != torch.uint8:
            raise DeviceError(f"group {gi}: {what} must have dtype torch.uint8, got {slot.dtype}")
        if slot.device.type != "cpu":
            raise DeviceError(
                f"group {gi}: {what} must be in host memory, got device {slot.device}"
            )
        if slot.numel() != group.chunk_nbytes:
            raise DeviceError(
                f"group {gi}: {what} holds {slot.numel()} bytes but a chunk is "
                f"{group.chunk_nbytes} bytes"
            )
        if not slot.is_contiguous():
            raise DeviceError(f"group {gi}: {what} must be contiguous")

    # -- copies --------------------------------------------------------------------------------

    def gather(
        self,
        group_index: int,
        block_ids: Sequence[int],
        out: torch.Tensor,
        *,
        compute_stream: Optional["torch.cuda.Stream"] = None,
    ) -> CopyHandle:
        """Copy the blocks ``block_ids`` (all layers) of one chunk into the host slot ``out``
        (``uint8``, ``chunk_nbytes`` bytes), layer-major. On CUDA the copy waits, on the GPU, for
        the work queued so far on ``compute_stream`` (it may still be writing these blocks)."""
        return self.gather_many(group_index, [(block_ids, out)], compute_stream=compute_stream)

    def gather_many(
        self,
        group_index: int,
        items: Sequence[GatherItem],
        *,
        compute_stream: Optional["torch.cuda.Stream"] = None,
    ) -> CopyHandle:
        """``gather`` for a batch of chunks of one group: every item is validated before any copy is
        queued, and the batch completes under one event."""
        return self.gather_many_groups(
            [(group_index, block_ids, out) for block_ids, out in items],
            compute_stream=compute_stream,
            wait=False,
        )

    def gather_many_groups(
        self,
        items: Sequence[GroupGatherItem],
        *,
        compute_stream: Optional["torch.cuda.Stream"] = None,
        ready_event: Any = None,
        wait: bool = True,
    ) -> CopyHandle:
        """``gather`` for ``(group_index, block_ids, out)`` items of any groups: one validation
        pass, one wait for the compute, one event. By default blocks until the copies finished: it
        is meant for the engine's copy thread. The copies wait for ``ready_event`` when given (an
        event the caller recorded after the kernels that wrote the blocks), else for an event
        recorded now on ``compute_stream`` (default: this thread's current stream). Per layer the
        batch's blocks are gathered on the device into a staging buffer, moved in one copy per
        chunk. ``wait=False`` returns the pending handle instead."""
        ready = self.backend.ready_event(compute_stream, ready_event)
        if self._np_layers is not None:
            cpu_plans: List[_CpuPlan] = []
            for index, (gi, block_ids, out) in enumerate(items):
                group = self._group(gi)
                runs = self._runs(gi, group, block_ids, allow_none=False, seen={})
                cpu_plans.append((gi, runs, self._host_array(gi, group, out, f"out (item {index})")))
            return self._cpu_copy(cpu_plans, to_host=True)
        plans: List[_Plan] = []
        for index, item in enumerate(items):
            gi, block_ids, out = item
            group = self._group(gi)
            # Duplicates across chunks of a gather are harmless reads; checked per chunk only.
            runs = self._runs(gi, group, block_ids, allow_none=False, seen={})
            typed = self._typed_slot(gi, group, out, f"out (item {index})")
            plans.append((group, runs, typed, out))
        handle = self._enqueue(plans, self._d2h_stream, ready, to_host=True)
        if wait:
            handle.wait()
        return handle

    def scatter(
        self,
        group_index: int,
        src: torch.Tensor,
        block_ids: Sequence[Optional[int]],
        *,
        compute_stream: Optional["torch.cuda.Stream"] = None,
    ) -> CopyHandle:
        """Copy the host slot ``src`` into the device blocks ``block_ids`` (all layers). A ``None``
        block id skips that block of the chunk (a sliding-window block the consumer never restores);
        its device block is not written. On CUDA the copy waits, on the GPU, for the work queued so
        far on ``compute_stream`` (it may still read the blocks' previous contents); call
        ``handle.wait_on_stream()`` (or ``wait()``) before the forward pass that reads them."""
        return self.scatter_many(group_index, [(src, block_ids)], compute_stream=compute_stream)

    def scatter_many(
        self,
        group_index: int,
        items: Sequence[ScatterItem],
        *,
        compute_stream: Optional["torch.cuda.Stream"] = None,
    ) -> CopyHandle:
        """``scatter`` for a batch of chunks of one group, validated in full before any copy is
        queued; one event for the batch. A device block written twice in one batch is an error (the
        result would depend on copy order)."""
        return self.scatter_many_groups(
            [(group_index, src, block_ids) for src, block_ids in items],
            compute_stream=compute_stream,
            wait=False,
        )

    def scatter_many_groups(
        self,
        items: Sequence[GroupScatterItem],
        *,
        compute_stream: Optional["torch.cuda.Stream"] = None,
        ready_event: Any = None,
        wait: bool = True,
    ) -> CopyHandle:
        """``scatter`` for ``(group_index, src, block_ids)`` items of any groups, validated in full
        before any copy is queued; one event. The copies wait for ``ready_event`` (or an event
        recorded now on ``compute_stream``): the kernels still reading the blocks' old contents.
        Blocks until done unless ``wait=False`` (see ``gather_many_groups``)."""
        ready = self.backend.ready_event(compute_stream, ready_event)
        seen: Dict[int, Dict[int, int]] = {}
        if self._np_layers is not None:
            cpu_plans: List[_CpuPlan] = []
            for index, (gi, src, block_ids) in enumerate(items):
                group = self._group(gi)
                runs = self._runs(gi, group, block_ids, allow_none=True, seen=seen.setdefault(gi, {}))
                cpu_plans.append((gi, runs, self._host_array(gi, group, src, f"src (item {index})")))
            return self._cpu_copy(cpu_plans, to_host=False)
        plans: List[_Plan] = []
        for index, item in enumerate(items):
            gi, src, block_ids = item
            group = self._group(gi)
            runs = self._runs(gi, group, block_ids, allow_none=True, seen=seen.setdefault(gi, {}))
            typed = self._typed_slot(gi, group, src, f"src (item {index})")
            plans.append((group, runs, typed, src))
        handle = self._enqueue(plans, self._h2d_stream, ready, to_host=False)
        if wait:
            handle.wait()
        return handle

    def _cpu_copy(self, plans: List["_CpuPlan"], to_host: bool) -> CopyHandle:
        """CPU: copy every run of every layer with numpy (inline, on the calling thread; the copies
        release the GIL). Validation of the whole batch happened before the first byte moved."""
        np_layers = self._np_layers
        assert np_layers is not None
        for gi, runs, host in plans:
            for li, layer in enumerate(np_layers[gi]):
                host_layer = host[li]
                for pos, block, length in runs:
                    if to_host:
                        np.copyto(host_layer[pos : pos + length], layer[block : block + length])
                    else:
                        np.copyto(layer[block : block + length], host_layer[pos : pos + length])
        return CopyHandle(self.backend, None)

    def _enqueue(self, plans: List[_Plan], stream: Any, ready: Any, to_host: bool) -> CopyHandle:
        """Queue a validated batch on ``stream`` after ``ready``: per group, windows of chunks
        staged on the device (``_copy_window``), then one event for the batch. Both directions
        wait: d2h because compute may still be writing the blocks (read-after-write), h2d because
        it may still read their old contents (write-after-read)."""
        backend = self.backend
        keepalive: List[torch.Tensor] = [host for _, _, _, host in plans]
        with backend.stream_scope(stream):
            backend.wait_event(stream, ready)
            try:
                for gi, window in self._windows(plans):
                    keepalive.extend(self._copy_window(gi, window, stream, to_host))
            except BaseException:
                # Copies queued before the failure may still run: wait for them before reporting,
                # so the caller frees slots and blocks only once nothing touches them.
                backend.synchronize(backend.record_event(stream))
                raise
            event = backend.record_event(stream)
        return CopyHandle(backend, event, keepalive)

    def _windows(self, plans: List[_Plan]):
        """The batch's plans per group, in windows whose staging fits ``STAGING_MAX_BYTES``."""
        by_group: Dict[int, List[_Plan]] = {}
        for plan in plans:
            by_group.setdefault(self._group_index[id(plan[0])], []).append(plan)
        for gi, group_plans in by_group.items():
            size = max(1, STAGING_MAX_BYTES // (2 * self._groups[gi].chunk_nbytes))
            for start in range(0, len(group_plans), size):
                yield gi, group_plans[start : start + size]

    def _copy_window(self, gi: int, window: List[_Plan], stream: Any, to_host: bool) -> List[torch.Tensor]:
        """One window of chunks of group ``gi``: one ``index_select`` (d2h) or ``index_copy_``
        (h2d) per layer over every block of the window, a transpose between the per-layer and the
        per-chunk staging when the window has several chunks, and one host copy per chunk. Returns
        the tensors the queued work uses."""
        backend = self.backend
        group = self._groups[gi]
        layers = self._bit_layers[gi]
        per, num_layers, count = group.blocks_per_chunk, len(layers), len(window)
        bits, device = layers[0].dtype, layers[0].device
        rows: List[int] = []
        blocks: List[int] = []
        for c, (_, runs, _, _) in enumerate(window):
            for pos, block, length in runs:
                rows.extend(range(c * per + pos, c * per + pos + length))
                blocks.extend(range(block, block + length))
        for layer in group.layers:
            backend.keep_alive_on(layer, stream)
        keep: List[torch.Tensor] = []
        block_index = backend.index_tensor(blocks, device, keep)
        by_layer = torch.empty((num_layers, count * per, *group.block_shape), dtype=bits, device=device)
        # The window's chunks in their host form, one after another; the same memory for one chunk.
        by_chunk = by_layer.view(1, num_layers, per, *group.block_shape) if count == 1 else torch.empty(
            (count, num_layers, per, *group.block_shape), dtype=bits, device=device)
        keep += [by_layer, by_chunk]
        if to_host:
            for li, layer in enumerate(layers):
                torch.index_select(layer, 0, block_index, out=by_layer[li])
            if count > 1:
                by_chunk.copy_(by_layer.view(num_layers, count, per, *group.block_shape).transpose(0, 1))
            for c, (_, _, typed, _) in enumerate(window):
                backend.copy(typed.view(bits), by_chunk[c])
            return keep
        for c, (_, _, typed, _) in enumerate(window):
            backend.copy(by_chunk[c], typed.view(bits))
        if count > 1:
            by_layer.view(num_layers, count, per, *group.block_shape).copy_(by_chunk.transpose(0, 1))
        row_index = None if len(rows) == count * per else backend.index_tensor(rows, device, keep)
        for li, layer in enumerate(layers):
            source = by_layer[li] if row_index is None else by_layer[li].index_select(0, row_index)
            layer.index_copy_(0, block_index, source)
        return keep
