"""The view of the serving process's paged KV tensors: ``DeviceKVView``.

Primitives (the backend that hides cpu/cuda, ``DeviceBackend``, and ``CopyHandle`` live in
``tiers.device_backend``; the checks on a group's tensors, block ids and host slots in
``tiers.device_groups``):

- ``DeviceKVView``: per group, the layer tensors whose first dimension is the device block index.
  ``gather``/``gather_many`` copy a chunk's blocks (all layers, layer-major) into host ``uint8``
  slots; ``scatter``/``scatter_many`` copy host slots into device blocks (``None`` skips a block).
  They return a ``CopyHandle`` as soon as the copies are queued. ``gather_many_groups`` /
  ``scatter_many_groups`` take items of several groups and by default block until done. On CUDA a
  batch waits for a ready event (the caller's, or one recorded on the compute stream when called),
  then per layer one ``index_select`` / ``index_copy_`` over the batch into device staging (one for
  every layer when the layers are evenly spaced slices of one allocation: ``stacked_layers``) and
  one host copy per chunk (per span of back-to-back host slots), on the view's own copy stream; a
  batch failing partway waits for what it queued before raising. On CPU: one numpy copy per layer
  per span (or run of blocks), one for every layer when they are stacked. ``tools/testing/device.RecordingBackend`` runs that path on CPU.

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

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kvtier.errors import DeviceError
from kvtier.policy import ModelLayout

from .device_backend import CopyHandle, DeviceBackend
from .device_groups import (GroupTensors, Run, adjacent_span, block_runs, check_bits_slot, host_array,
                            stacked_layers, typed_slot, validate_group)

__all__ = ["DeviceKVView", "GatherItem", "ScatterItem", "GroupGatherItem", "GroupScatterItem"]

# Device staging per window of a batch: chunks are gathered per layer into it and moved in one copy
# per chunk. 64 MiB bounds what a batch borrows from the serving process's device memory.
STAGING_MAX_BYTES = 64 << 20

# Integer dtypes by element size: CPU copies move bits, whatever float format the KV cache uses.
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

GatherItem = Tuple[Sequence[int], torch.Tensor]  # (block_ids, out)
ScatterItem = Tuple[torch.Tensor, Sequence[Optional[int]]]  # (src, block_ids)
GroupGatherItem = Tuple[int, Sequence[int], torch.Tensor]  # (group_index, block_ids, out)
# (group_index, src, block_ids)
GroupScatterItem = Tuple[int, torch.Tensor, Sequence[Optional[int]]]
# (group, runs, host slot seen as the chunk's dtype and shape, the caller's host tensor)
_Plan = Tuple[GroupTensors, List[Run], torch.Tensor, torch.Tensor]
# CPU fast path: (group index, runs, the caller's host slot, checked)
_CpuPlan = Tuple[int, List[Run], torch.Tensor]


class DeviceKVView:
    """The serving process's paged KV cache, seen as chunks.

    ``kv_caches[g]`` is the list of layer tensors of group ``g`` of ``layout``; each has the device
    block index as its first dimension and, within a group, the same per-block shape, dtype, block
    count and device (strides may differ: a permuted K/V tensor copies correctly, just in more
    pieces). A chunk of group ``g`` is ``layout.groups[g].blocks_per_chunk`` blocks; its host form
    is ``chunk_nbytes(g)`` bytes laid out as ``chunk_shape(g) = (num_layers, blocks_per_chunk,
    *block_shape)`` in the group's dtype (layer-major, so one layer's blocks are contiguous).

    All tensors must live on one cpu or cuda device. Errors (``DeviceError``) name the group, and
    the layer or block at fault. Any thread: it holds no mutable Python state (the module docstring
    says which threads the engine uses); ``compute_stream`` arguments default to the calling
    thread's current stream.
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
        groups: List[GroupTensors] = []
        device: Optional[torch.device] = None
        for gi, (spec, layers) in enumerate(zip(layout.groups, kv_caches)):
            group = validate_group(gi, spec.blocks_per_chunk, layers, spec.block_size)
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
        self._groups: Tuple[GroupTensors, ...] = tuple(groups)
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
        # Per group, the same layers as one tensor when they are evenly spaced slices of one
        # allocation (``stacked_layers``), else None: then one copy (CPU) or one index_select /
        # index_copy_ (CUDA) moves a run of blocks of every layer. On CPU that is one GIL take per
        # span instead of one per layer, each of which can wait a switch interval beside a busy loop.
        self._bit_stacked = tuple(stacked_layers(layers) for layers in self._bit_layers)
        self._np_stacked = (tuple(None if t is None else t.numpy() for t in self._bit_stacked)
                            if self._np_layers is not None else None)

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

    def _group(self, group_index: int) -> GroupTensors:
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

    # -- copies --------------------------------------------------------------------------------

    def gather(self, group_index: int, block_ids: Sequence[int], out: torch.Tensor, *,
               compute_stream: Optional["torch.cuda.Stream"] = None) -> CopyHandle:
        """Copy the blocks ``block_ids`` (all layers) of one chunk into the host slot ``out``
        (``uint8``, ``chunk_nbytes`` bytes), layer-major. On CUDA the copy waits, on the GPU, for
        the work queued so far on ``compute_stream`` (it may still be writing these blocks)."""
        return self.gather_many(group_index, [(block_ids, out)], compute_stream=compute_stream)

    def gather_many(self, group_index: int, items: Sequence[GatherItem], *,
                    compute_stream: Optional["torch.cuda.Stream"] = None) -> CopyHandle:
        """``gather`` for a batch of chunks of one group: every item is validated before any copy is
        queued, and the batch completes under one event."""
        return self.gather_many_groups([(group_index, block_ids, out) for block_ids, out in items],
                                       compute_stream=compute_stream, wait=False)

    def gather_many_groups(self, items: Sequence[GroupGatherItem], *,
                           compute_stream: Optional["torch.cuda.Stream"] = None, ready_event: Any = None,
                           wait: bool = True) -> CopyHandle:
        """``gather`` for ``(group_index, block_ids, out)`` items of any groups: one validation
        pass, one wait for the compute, one event. By default blocks until the copies finished: it
        is meant for the engine's copy thread. The copies wait for ``ready_event`` when given (an
        event the caller recorded after the kernels that wrote the blocks), else for an event
        recorded now on ``compute_stream`` (default: this thread's current stream). Per layer the
        batch's blocks are gathered on the device into a staging buffer, moved in one copy per
        chunk. ``wait=False`` returns the pending handle instead."""
        return self._copy_groups(items, True, compute_stream, ready_event, wait)

    def scatter(self, group_index: int, src: torch.Tensor, block_ids: Sequence[Optional[int]], *,
                compute_stream: Optional["torch.cuda.Stream"] = None) -> CopyHandle:
        """Copy the host slot ``src`` into the device blocks ``block_ids`` (all layers). A ``None``
        block id skips that block of the chunk (a sliding-window block the consumer never restores);
        its device block is not written. On CUDA the copy waits, on the GPU, for the work queued so
        far on ``compute_stream`` (it may still read the blocks' previous contents); call
        ``handle.wait_on_stream()`` (or ``wait()``) before the forward pass that reads them."""
        return self.scatter_many(group_index, [(src, block_ids)], compute_stream=compute_stream)

    def scatter_many(self, group_index: int, items: Sequence[ScatterItem], *,
                     compute_stream: Optional["torch.cuda.Stream"] = None) -> CopyHandle:
        """``scatter`` for a batch of chunks of one group, validated in full before any copy is
        queued; one event for the batch. A device block written twice in one batch is an error (the
        result would depend on copy order)."""
        return self.scatter_many_groups([(group_index, src, block_ids) for src, block_ids in items],
                                        compute_stream=compute_stream, wait=False)

    def scatter_many_groups(self, items: Sequence[GroupScatterItem], *,
                            compute_stream: Optional["torch.cuda.Stream"] = None, ready_event: Any = None,
                            wait: bool = True) -> CopyHandle:
        """``scatter`` for ``(group_index, src, block_ids)`` items of any groups, validated in full
        before any copy is queued; one event. The copies wait for ``ready_event`` (or an event
        recorded now on ``compute_stream``): the kernels still reading the blocks' old contents.
        Blocks until done unless ``wait=False`` (see ``gather_many_groups``)."""
        return self._copy_groups(items, False, compute_stream, ready_event, wait)

    def _copy_groups(self, items: Sequence[Any], to_host: bool, compute_stream: Any, ready_event: Any,
                     wait: bool) -> CopyHandle:
        """``gather_many_groups`` (``to_host``: items ``(group_index, block_ids, out)``) or
        ``scatter_many_groups`` (items ``(group_index, src, block_ids)``): the ready point taken,
        every item validated in order, then the batch queued (CPU: copied inline)."""
        ready = self.backend.ready_event(compute_stream, ready_event)
        what = "out" if to_host else "src"
        # Duplicates across chunks of a gather are harmless reads, checked per chunk only; a scatter
        # writing one device block twice would depend on copy order, checked over the batch.
        seen: Dict[int, Dict[int, int]] = {}
        cpu_plans: List[_CpuPlan] = []
        plans: List[_Plan] = []
        groups = self._groups
        for index, item in enumerate(items):
            if to_host:
                gi, block_ids, host = item
            else:
                gi, host, block_ids = item
            group = groups[gi] if type(gi) is int and 0 <= gi < len(groups) else self._group(gi)
            runs = block_runs(gi, group, block_ids, allow_none=not to_host,
                              seen={} if to_host else seen.setdefault(gi, {}))
            label = f"{what} (item {index})"
            if self._np_layers is not None:
                check_bits_slot(gi, group, host, label, self._np_layers[gi][0].dtype)
                cpu_plans.append((gi, runs, host))
            else:
                plans.append((group, runs, typed_slot(gi, group, host, label), host))
        if self._np_layers is not None:
            return self._cpu_copy(cpu_plans, to_host=to_host)
        handle = self._enqueue(plans, self._d2h_stream if to_host else self._h2d_stream, ready, to_host=to_host)
        if wait:
            handle.wait()
        return handle

    def _cpu_copy(self, plans: List["_CpuPlan"], to_host: bool) -> CopyHandle:
        """CPU: copy with numpy (inline, on the calling thread; the copies release the GIL).
        Validation of the whole batch happened before the first byte moved. Consecutive items of
        one group whose host slots lie back to back and whose blocks continue one another (a store
        of consecutive chunks into consecutive slots) are one span: one copy per layer for the
        span, not per chunk; the calling thread then takes the GIL a few times per batch instead
        of a few times per chunk (beside a busy event loop each take can wait its switch
        interval). Any other item: one copy per run of blocks per layer."""
        np_layers, np_stacked = self._np_layers, self._np_stacked
        assert np_layers is not None and np_stacked is not None
        hosts = [host for _, _, host in plans]
        joins = [False] + [_continues(self._groups[after[0]].blocks_per_chunk, before, after)
                           for before, after in zip(plans, plans[1:])]
        i = 0
        while i < len(plans):
            gi, runs, host = plans[i]
            group, layers, stacked = self._groups[gi], np_layers[gi], np_stacked[gi]
            bits = layers[0].dtype
            count, span = adjacent_span(hosts, i, group.chunk_nbytes, joins)
            # (host side, device side) numpy views of equal shape, one copy each.
            pairs: List[Tuple[np.ndarray, np.ndarray]]
            if span is not None:
                per, first = group.blocks_per_chunk, runs[0][1]
                spanned = span.numpy().view(bits).reshape((count, *group.chunk_shape))
                if stacked is not None:  # [count, layers, per, ...] on both sides
                    pairs = [(spanned, _split_blocks(stacked[:, first : first + count * per], count, per, 1)
                              .swapaxes(0, 1))]
                else:
                    pairs = [(spanned[:, li], _split_blocks(layer[first : first + count * per], count, per))
                             for li, layer in enumerate(layers)]
            else:
                chunk = host_array(group, host, bits)
                if stacked is not None:
                    pairs = [(chunk[:, pos : pos + length], stacked[:, block : block + length])
                             for pos, block, length in runs]
                else:
                    pairs = [(chunk[li, pos : pos + length], layer[block : block + length])
                             for li, layer in enumerate(layers) for pos, block, length in runs]
            for host_side, device_side in pairs:
                if to_host:
                    np.copyto(host_side, device_side)
                else:
                    np.copyto(device_side, host_side)
            i += count
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
        per-chunk staging when the window has several chunks, and one host copy per chunk or span of
        back-to-back host slots. Returns the tensors the queued work uses."""
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
        stacked = self._bit_stacked[gi]
        if to_host:
            if stacked is not None:  # every layer in one kernel
                torch.index_select(stacked, 1, block_index, out=by_layer)
            else:
                for li, layer in enumerate(layers):
                    torch.index_select(layer, 0, block_index, out=by_layer[li])
            if count > 1:
                by_chunk.copy_(by_layer.view(num_layers, count, per, *group.block_shape).transpose(0, 1))
        # One host copy per span of back-to-back host slots (the engine's slots of one store are
        # usually consecutive), else per chunk.
        hosts = [host for _, _, _, host in window]
        c = 0
        while c < count:
            spanned, span = adjacent_span(hosts, c, group.chunk_nbytes)
            host_side = (window[c][2].view(bits) if span is None
                         else span.view(bits).view(spanned, num_layers, per, *group.block_shape))
            device_side = by_chunk[c] if span is None else by_chunk[c : c + spanned]
            if to_host:
                backend.copy(host_side, device_side)
            else:
                backend.copy(device_side, host_side)
            c += spanned
        if to_host:
            return keep
        if count > 1:
            by_layer.view(num_layers, count, per, *group.block_shape).copy_(by_chunk.transpose(0, 1))
        row_index = None if len(rows) == count * per else backend.index_tensor(rows, device, keep)
        if stacked is not None:
            stacked.index_copy_(1, block_index, by_layer if row_index is None else by_layer.index_select(1, row_index))
            return keep
        for li, layer in enumerate(layers):
            source = by_layer[li] if row_index is None else by_layer[li].index_select(0, row_index)
            layer.index_copy_(0, block_index, source)
        return keep


def _continues(per: int, before: "_CpuPlan", after: "_CpuPlan") -> bool:
    """Whether ``after`` may join ``before`` in one span: the same group, each chunk one run of all
    its blocks, ``after``'s blocks right behind ``before``'s."""
    (gi_before, runs_before, _), (gi_after, runs_after, _) = before, after
    return (gi_before == gi_after and len(runs_before) == 1 and len(runs_after) == 1
            and runs_before[0][2] == per and runs_after[0][2] == per
            and runs_after[0][1] == runs_before[0][1] + per)


def _split_blocks(blocks: np.ndarray, count: int, per: int, axis: int = 0) -> np.ndarray:
    """``blocks`` (``count * per`` consecutive blocks of a layer along ``axis``; 1 for the stacked
    layers) seen as ``count`` chunks of ``per`` blocks: a view (splitting an axis never copies;
    assigning ``shape`` raises if it would, so a scatter can never write into a copy)."""
    view = blocks.view()
    view.shape = (*blocks.shape[:axis], count, per, *blocks.shape[axis + 1 :])
    return view
