"""The device side: a small cpu/cuda backend and the view of the serving process's paged KV tensors.

Primitives:

- ``DeviceBackend``: every CUDA specific of kvtier in one place (host buffers pinned by
  ``cudaHostRegister``, copy streams, completion events, stream ordering). On CPU the same methods
  are no-ops or plain allocations, so the host pool and the device view run one code path on both.
- ``DeviceKVView``: per group, the layer tensors whose first dimension is the device block index.
  ``gather``/``gather_many`` copy a chunk's blocks (all layers, layer-major) into host ``uint8``
  slots; ``scatter``/``scatter_many`` copy host slots into device blocks (``None`` skips a block).
  They return a ``CopyHandle`` as soon as the copies are queued. ``gather_many_groups`` /
  ``scatter_many_groups`` take items of several groups and by default block until done.
- ``CopyHandle``: completion of one enqueued batch: ``done()`` polls, ``wait()`` blocks,
  ``wait_on_stream()`` orders a CUDA stream after the copy without blocking the host.

Threads: the view holds no mutable Python state, and torch's current-stream context is per thread,
so calls may come from any thread. The intended use is the engine's: one copy thread per direction
(device->host, host->device), each call validating its whole batch and then queueing it. Two threads
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
from dataclasses import dataclass
from math import prod
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from kvtier.policy import DeviceError, ModelLayout

__all__ = ["DeviceBackend", "DeviceKVView", "CopyHandle"]

_PAGE_BYTES = 4096
# cudaHostRegisterPortable: the pinned range counts as pinned for every CUDA context, so a pool made
# while another device is current still gets async copies.
_CUDA_HOST_REGISTER_PORTABLE = 1

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
        self._lock = threading.Lock()  # release may run from a GC finalizer on another thread

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
        costs ~1 GB/s on these machines) so no page fault lands on the copy path. Pair with
        ``release_host_buffer``.
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        raw = torch.empty(nbytes + _PAGE_BYTES, dtype=torch.uint8)
        # Page alignment keeps slot boundaries page-aligned when slots are page multiples (direct
        # I/O and DMA both prefer it); the slack is one page.
        offset = (-raw.data_ptr()) % _PAGE_BYTES
        buffer = raw[offset : offset + nbytes]
        buffer.zero_()  # pre-fault: touch every page now, off the hot path
        if self.is_cuda:
            cudart = torch.cuda.cudart()
            base = buffer.data_ptr()
            code = int(cudart.cudaHostRegister(base, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
            if code != 0:
                raise DeviceError(
                    f"cudaHostRegister of {nbytes} bytes failed with cudaError {code} "
                    "(locked-memory limit, `ulimit -l`, or an earlier asynchronous CUDA error)"
                )
            with self._lock:
                self._registered[base] = base
        return buffer

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

    def new_stream(self) -> Optional["torch.cuda.Stream"]:
        """A dedicated copy stream (CUDA), ``None`` on CPU."""
        if not self.is_cuda:
            return None
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Optional["torch.cuda.Stream"]:
        """The calling thread's current (compute) stream on this device; ``None`` on CPU."""
        if not self.is_cuda:
            return None
        return torch.cuda.current_stream(self.device)

    def stream_scope(self, stream: Optional["torch.cuda.Stream"]) -> ContextManager[Any]:
        """Context in which copies are enqueued on ``stream`` (and its device is current)."""
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def wait_stream(self, stream: Optional["torch.cuda.Stream"], other: Any) -> None:
        """Make ``stream`` wait (on the GPU, host not blocked) for the work queued on ``other``."""
        if stream is not None and other is not None:
            stream.wait_stream(other)

    def record_event(self, stream: Optional["torch.cuda.Stream"]) -> Optional["torch.cuda.Event"]:
        """An event recorded on ``stream`` after the work queued so far; ``None`` on CPU (done)."""
        if stream is None:
            return None
        # blocking=True: event.synchronize() yields the CPU instead of spinning; the waiter is a
        # worker thread on a host with few cores, where a spinning waiter starves the event loop.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    @property
    def non_blocking(self) -> bool:
        """Whether copies may be asynchronous (CUDA with pinned host memory)."""
        return self.is_cuda


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
        event: Optional["torch.cuda.Event"],
        keepalive: Sequence[torch.Tensor] = (),
    ) -> None:
        self._backend = backend
        self._event = event
        self._keepalive: Optional[Sequence[torch.Tensor]] = keepalive if event is not None else None

    def done(self) -> bool:
        if self._event is None:
            return True
        if self._event.query():
            self._keepalive = None
            return True
        return False

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._keepalive = None

    def wait_on_stream(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        if self._event is None:
            return
        if stream is None:
            stream = self._backend.current_stream()
        if stream is not None:
            stream.wait_event(self._event)

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
        self.backend = DeviceBackend(device)
        self._groups: Tuple[_GroupTensors, ...] = tuple(groups)
        # One stream per direction, so stores (d2h) and loads (h2d) overlap each other and compute.
        self._d2h_stream = self.backend.new_stream()
        self._h2d_stream = self.backend.new_stream()
        # CPU: numpy views of every layer (made once), so a copy costs ~1 us of Python instead of
        # the ~10 us of torch indexing and dispatch per layer; at 256 KiB chunks that overhead was
        # as large as the copy itself. None on CUDA (streams and events need torch's copies).
        self._np_layers = None if self.backend.is_cuda else self._numpy_layers()

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
        wait: bool = True,
    ) -> CopyHandle:
        """``gather`` for ``(group_index, block_ids, out)`` items of any groups: one validation
        pass, one stream sync, one event. By default blocks until the copies finished: it is meant
        for the engine's copy thread. On CUDA that thread's current stream is usually the default
        stream, so pass the serving process's ``compute_stream`` if it computes on another one.
        ``wait=False`` returns the pending handle instead."""
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
        handle = self._enqueue(plans, self._d2h_stream, compute_stream, to_host=True)
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
        wait: bool = True,
    ) -> CopyHandle:
        """``scatter`` for ``(group_index, src, block_ids)`` items of any groups, validated in full
        before any copy is queued; one event. Blocks until done unless ``wait=False`` (see
        ``gather_many_groups``)."""
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
        handle = self._enqueue(plans, self._h2d_stream, compute_stream, to_host=False)
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

    def _enqueue(
        self,
        plans: List[_Plan],
        stream: Optional["torch.cuda.Stream"],
        compute_stream: Optional["torch.cuda.Stream"],
        to_host: bool,
    ) -> CopyHandle:
        backend = self.backend
        # Capture the compute stream before entering the copy stream's scope, where "current"
        # would be the copy stream itself. Both directions wait: d2h because compute may still be
        # writing the blocks (read-after-write), h2d because it may still read their old contents
        # (write-after-read).
        if compute_stream is None:
            compute_stream = backend.current_stream()
        backend.wait_stream(stream, compute_stream)
        non_blocking = backend.non_blocking
        with backend.stream_scope(stream):
            for group, runs, typed, _ in plans:
                for li, layer in enumerate(group.layers):
                    host_layer = typed[li]
                    for pos, block, length in runs:
                        host_part = host_layer[pos : pos + length]
                        device_part = layer[block : block + length]
                        if to_host:
                            host_part.copy_(device_part, non_blocking=non_blocking)
                        else:
                            device_part.copy_(host_part, non_blocking=non_blocking)
            event = backend.record_event(stream)
        return CopyHandle(backend, event, [host for _, _, _, host in plans])
