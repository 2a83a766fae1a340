"""One group of the serving process's KV tensors, and the checks on what a copy is handed.

Primitives: ``GroupTensors`` (a group's layer tensors and shared geometry), ``validate_group``
(the checks on a group's layer tensors), ``block_runs`` (one chunk's block ids checked and
coalesced into runs of consecutive blocks), ``check_slot`` / ``typed_slot`` / ``check_bits_slot`` /
``host_array`` (a host slot checked, seen as the chunk's dtype and shape, or as a numpy array of
same-size integers),
``adjacent_span`` (how many host slots from a position lie back to back in one buffer, and the
memory they span as one tensor), ``stacked_layers`` (a group's layers seen as one tensor when they
are evenly spaced slices of one allocation).
Every failure is a ``DeviceError`` that names the group, and the layer, block or item at fault.
Plain functions of their arguments, safe on any thread; ``DeviceKVView`` (``tiers.device``) calls
them to validate a whole batch before it queues any copy.
"""

from __future__ import annotations

import operator
from collections import abc
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kvtier.errors import DeviceError

__all__ = ["GroupTensors", "Run", "validate_group", "block_runs", "check_slot", "typed_slot", "host_array",
           "check_bits_slot", "adjacent_span", "stacked_layers"]

# (position in the chunk, first device block, number of consecutive blocks)
Run = Tuple[int, int, int]


@dataclass(frozen=True)
class GroupTensors:
    """One group's layer tensors and the geometry every layer shares (made by ``validate_group``).
    Immutable: any thread."""

    layers: Tuple[torch.Tensor, ...]
    dtype: torch.dtype
    block_shape: Tuple[int, ...]
    num_blocks: int
    blocks_per_chunk: int
    block_nbytes: int  # bytes of one block of one layer

    @cached_property  # asked per chunk of every copy batch
    def chunk_shape(self) -> Tuple[int, ...]:
        return (len(self.layers), self.blocks_per_chunk, *self.block_shape)

    @cached_property
    def chunk_nbytes(self) -> int:
        return len(self.layers) * self.blocks_per_chunk * self.block_nbytes


def validate_group(
    gi: int, blocks_per_chunk: int, layers: Sequence[torch.Tensor], block_size: int = 0
) -> GroupTensors:
    """Check group ``gi``'s layer tensors (same dtype, per-block shape, block count and device; the
    block index first; at least one chunk of blocks) and describe them; ``DeviceError`` names the
    layer at fault."""
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
    return GroupTensors(
        layers=tuple(layers),
        dtype=first.dtype,
        block_shape=block_shape,
        num_blocks=int(first.shape[0]),
        blocks_per_chunk=blocks_per_chunk,
        block_nbytes=block_nbytes,
    )


def block_runs(
    gi: int,
    group: GroupTensors,
    block_ids: Sequence[Optional[int]],
    allow_none: bool,
    seen: Dict[int, int],
) -> List[Run]:
    """Validate one chunk's block ids and coalesce consecutive ones into runs (one copy per run
    per layer instead of one per block: block tables are often consecutive)."""
    # list and tuple first: the abstract Sequence check costs ~1 us a chunk, as much as the rest.
    if type(block_ids) is not list and type(block_ids) is not tuple and (
            isinstance(block_ids, (str, bytes, torch.Tensor)) or not isinstance(block_ids, abc.Sequence)):
        raise DeviceError(
            f"group {gi}: block ids must be a sequence of ints, got {type(block_ids).__name__}"
        )
    if len(block_ids) != group.blocks_per_chunk:
        raise DeviceError(
            f"group {gi}: a chunk has {group.blocks_per_chunk} block(s), got "
            f"{len(block_ids)} block id(s)"
        )
    runs: List[Run] = []
    num_blocks = group.num_blocks
    for pos, raw in enumerate(block_ids):
        if type(raw) is int and 0 <= raw < num_blocks and raw not in seen:  # the usual block id
            block = raw
        elif raw is None:
            if not allow_none:
                raise DeviceError(
                    f"group {gi}: block_ids[{pos}] is None; gather needs every block"
                )
            continue
        else:
            block = _checked_block(gi, group, raw, pos, seen)
        seen[block] = pos
        if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == block:
            start_pos, start_block, length = runs[-1]
            runs[-1] = (start_pos, start_block, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


def _checked_block(gi: int, group: GroupTensors, raw: object, pos: int, seen: Dict[int, int]) -> int:
    """``block_ids[pos]`` that is not a plain int in range seen for the first time: an int-like
    in range and new (returned as an int), else the ``DeviceError`` saying why not."""
    try:
        if isinstance(raw, bool):
            raise TypeError
        block = operator.index(raw)  # type: ignore[arg-type]
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
    return block


def check_bits_slot(gi: int, group: GroupTensors, slot: torch.Tensor, what: str, bits: np.dtype) -> None:
    """CPU fast path: checks exactly what ``typed_slot`` checks, with the same errors, for a slot
    to be seen in same-size integers ``bits`` (the numpy dtype of the group's layers) by
    ``host_array``, or copied as part of a span of adjacent slots."""
    check_slot(gi, group, slot, what)
    if slot.data_ptr() % bits.itemsize:
        raise DeviceError(f"group {gi}: {what} cannot be viewed as {group.dtype} (misaligned start?)")


def host_array(group: GroupTensors, slot: torch.Tensor, bits: np.dtype) -> np.ndarray:
    """A slot ``check_bits_slot`` passed as a numpy array of the chunk's shape, in same-size
    integers ``bits`` (a view, no copy)."""
    # uint8 tensors never require grad, so numpy() always hands out the view.
    return slot.numpy().reshape(-1).view(bits).reshape(group.chunk_shape)


def typed_slot(gi: int, group: GroupTensors, slot: torch.Tensor, what: str) -> torch.Tensor:
    """The host slot seen as the chunk's dtype and shape (a view, no copy)."""
    check_slot(gi, group, slot, what)
    try:
        return slot.reshape(-1).view(group.dtype).view(group.chunk_shape)
    except RuntimeError as exc:
        # A byte view as a wider dtype needs the start aligned to the element size.
        raise DeviceError(
            f"group {gi}: {what} cannot be viewed as {group.dtype} (misaligned start?)"
        ) from exc


def check_slot(gi: int, group: GroupTensors, slot: torch.Tensor, what: str) -> None:
    """A host slot for one chunk of the group: a contiguous ``uint8`` CPU tensor of exactly
    ``chunk_nbytes``; ``DeviceError`` naming ``what`` otherwise."""
    if not isinstance(slot, torch.Tensor):
        raise DeviceError(f"group {gi}: {what} must be a tensor, got {type(slot).__name__}")
    if slot.dtype != torch.uint8:
        raise DeviceError(f"group {gi}: {what} must have dtype torch.uint8, got {slot.dtype}")
    if not slot.is_cpu:
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


def adjacent_span(hosts: Sequence[torch.Tensor], start: int, nbytes: int,
                  joins: Optional[Sequence[bool]] = None) -> Tuple[int, Optional[torch.Tensor]]:
    """How many of ``hosts`` from ``start`` on (checked slots of ``nbytes`` each) lie back to back
    in one buffer, and, when more than one does, that memory as one ``uint8`` tensor over the first
    slot's storage (``None`` for a span of one). ``joins[i]`` false keeps slot ``i`` from joining
    the slot before it (a caller's further condition). The engine's host slots of a store are
    usually consecutive slots of one slab: a span is copied in one call instead of one per slot."""
    first = hosts[start]
    end = start + 1
    ptr = first.data_ptr() + nbytes
    while end < len(hosts) and hosts[end].data_ptr() == ptr and (joins is None or joins[end]):
        end += 1
        ptr += nbytes
    count = end - start
    if count == 1:
        return 1, None
    try:
        # Within the first slot's storage (the bounds are checked): the span is that storage's memory.
        return count, first.as_strided((count * nbytes,), (1,), first.storage_offset())
    except RuntimeError:  # adjacent memory of another allocation: slot by slot
        return 1, None


def stacked_layers(layers: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The layer tensors (``validate_group`` passed them) as one view ``[num_layers, num_blocks,
    *block_shape]`` when they are slices of one storage at evenly spaced offsets, with the same
    strides, none overlapping the next: a KV cache allocated as one tensor and handed over layer by
    layer (the bench's geometry; vLLM's and SGLang's per-layer allocations are not). Then a copy
    moves every layer of a run of blocks in one call instead of one per layer. ``None`` otherwise
    (separate allocations, uneven spacing, negative strides, a single layer)."""
    if len(layers) < 2:
        return None
    first = layers[0]
    strides = first.stride()
    if any(st <= 0 for st in strides):
        return None
    storage = first.untyped_storage().data_ptr()
    step = layers[1].storage_offset() - first.storage_offset()
    # The last element of a layer lies this many elements past its first: the next layer must start beyond it.
    extent = sum((size - 1) * st for size, st in zip(first.shape, strides)) + 1
    if step < extent:
        return None
    for li, layer in enumerate(layers):
        if (layer.untyped_storage().data_ptr() != storage or layer.stride() != strides
                or layer.storage_offset() != first.storage_offset() + li * step):
            return None
    return first.as_strided((len(layers), *first.shape), (step, *strides), first.storage_offset())
