"""Argument checks for the engine's public methods, and for settings once the layout is known.

Primitives: ``check_token_ids``, ``check_count``, ``check_request_keys``, ``check_store_arguments``,
``check_load_arguments``, ``check_fence_arguments``, ``check_timeout``, ``check_engine_settings``. Pure and synchronous; they run on the caller's
thread before anything is scheduled, so a bad argument is the caller's typed error (``TypeError``
for a wrong kind of value, ``ValueError`` for a wrong value, each naming the argument and the value),
never a wrong result or a failure on a worker thread later.

Why strict: a block id ``1.9`` that ``int()`` truncates to 1 stores the wrong device block's KV
under the right key, and every later hit serves it. So a block id or a token count must be an
integer: a Python int, or a numpy / torch integer scalar; never a bool, a float or a string.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Set
from typing import Any, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from kvtier.errors import DeviceError
from kvtier.policy import ModelLayout
from kvtier.policy.plan import store_chunk_indices

__all__ = [
    "check_token_ids",
    "check_count",
    "check_request_keys",
    "check_store_arguments",
    "check_load_arguments",
    "check_load_targets",
    "check_store_blocks",
    "valid_store_run",
    "check_load_blocks",
    "valid_load_plan_targets",
    "check_fence_arguments",
    "check_timeout",
    "check_prefetch_policy",
    "check_engine_settings",
]

logger = logging.getLogger("kvtier.engine")

BlockRow = List[Optional[int]]
_NOT_INTEGER = (bool, np.bool_, float, np.floating, complex, str, bytes)


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _as_int(value: Any, what: str) -> int:
    """``value`` as an int when it is an integer (int, numpy or torch integer scalar), else a
    ``TypeError`` naming ``what``."""
    if type(value) is int:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
            return int(value.item())
    elif not isinstance(value, _NOT_INTEGER) and isinstance(value, (int, np.integer)):
        return int(value)
    raise TypeError(f"{what} must be an int (numpy and torch integer scalars are fine), got {_describe(value)}")


def _integer_array(value: Any, what: str) -> Optional[List[int]]:
    """A 1-D numpy or torch integer array as a list of ints; ``None`` when ``value`` is neither."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(f"{what} must be a 1-D integer array, got a {value.ndim}-D array of {value.dtype}")
        return value.tolist()
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
        if value.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{what} must be a 1-D integer tensor, got a {value.dim()}-D tensor of {dtype}")
        return value.tolist()
    return None


def _int_list(value: Any, what: str, *, allow_none: bool) -> List[Any]:
    """Every item of a sequence as an int (or None when allowed); the error names the index."""
    array = _integer_array(value, what)
    if array is not None:
        return array
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        hint = " (materialize an iterator with list(...))" if hasattr(value, "__next__") else ""
        raise TypeError(f"{what} must be a sequence of ints{hint}, got {_describe(value)}")
    kinds = set(map(type, value))
    if kinds <= {int}:  # the common case: one pass, no per-item Python code
        return list(value)
    out: List[Any] = []
    for index, item in enumerate(value):
        if item is None and allow_none:
            out.append(None)
        else:
            out.append(_as_int(item, f"{what}[{index}]"))
    return out


def check_token_ids(token_ids: Any, what: str = "token_ids") -> Any:
    """Refuse token ids that are not token ids at all, in O(1): ``None``, raw bytes or text
    (``bytes`` would otherwise be read as machine integers), a mapping or a set (no order, or keys
    that are not the prompt), a list whose first item is a bool (a mask, not tokens), and numpy /
    torch arrays of a non-integer dtype (a bool mask, float logits) or of more than one dimension.
    Item by item checks (floats, negatives, values past 2**32) are the key builder's, in C, on its
    conversion; a bool further inside a list is an int there (``True == 1``), as everywhere in
    Python: scanning a list's item types costs more than hashing it (~4x at 131072 tokens), on the
    lookup path."""
    if token_ids is None or isinstance(token_ids, (str, bytes, bytearray, memoryview, Mapping, Set)):
        raise TypeError(f"{what} must be a sequence of ints, got {_describe(token_ids)}")
    if isinstance(token_ids, (np.ndarray, torch.Tensor)):
        _integer_array(token_ids, what)
    elif not hasattr(token_ids, "__iter__"):
        raise TypeError(f"{what} must be a sequence of ints, got {_describe(token_ids)}")
    elif isinstance(token_ids, Sequence) and len(token_ids) and isinstance(token_ids[0], (bool, np.bool_)):
        raise TypeError(f"{what}[0] must be an int, got {_describe(token_ids[0])} (a mask is not token ids)")
    return token_ids


def check_request_keys(keys: Any, layout: ModelLayout) -> None:
    """``RequestKeys`` made by an engine of another layout name other chunks: refuse them
    (``ValueError``) instead of reading past a group's keys or answering a silent miss."""
    chain = keys.chain
    other = chain.layout if chain is not None else None
    if len(keys.keys) != len(layout.groups) or (other is not None and other != layout):
        raise ValueError(
            "these RequestKeys belong to another layout "
            f"({len(keys.keys)} group(s){'' if other is None else ': ' + _groups_text(other)}; this engine's: "
            f"{_groups_text(layout)}); make them with this engine's request_keys"
        )


def _groups_text(layout: ModelLayout) -> str:
    return ", ".join(
        f"{g.block_size}x{g.blocks_per_chunk}" + ("" if g.sliding_window is None else f" window {g.sliding_window}")
        for g in layout.groups
    )


def check_count(name: str, value: Any, upper: Optional[int]) -> int:
    """A token count in ``[0, upper]`` (no upper bound when ``upper`` is None), as an int."""
    count = _as_int(value, name)
    if count < 0 or (upper is not None and count > upper):
        bound = f"[0, {upper}]" if upper is not None else ">= 0"
        raise ValueError(f"{name} must be in {bound}, got {count}")
    return count


def _block_table(table: Any, layout: ModelLayout) -> List[BlockRow]:
    groups = len(layout.groups)
    if isinstance(table, (str, bytes, bytearray)) or not isinstance(table, Sequence):
        raise TypeError(f"block_table must be a sequence with one list of device block ids per group, got {_describe(table)}")
    if len(table) != groups:
        raise ValueError(f"block_table must have one list per group ({groups}), got {len(table)}")
    rows: List[BlockRow] = []
    for gi, row in enumerate(table):
        if isinstance(row, (int, np.integer)) or row is None:
            raise TypeError(
                f"block_table[{gi}] must be a sequence of device block ids, got {_describe(row)} "
                "(block_table is nested: one list per group)"
            )
        rows.append(_int_list(row, f"block_table[{gi}]", allow_none=True))
    return rows


def check_store_arguments(
    layout: ModelLayout, request_tokens: int, num_tokens: Any, block_table: Any
) -> Tuple[int, List[List[Optional[int]]]]:
    """``store``'s ``num_tokens`` (default: every token) and ``block_table``, checked and
    normalised. Every block the store mask selects must have its own device block: a ``None`` there
    or one device block given to two selected blocks of a group is refused (``ValueError``)."""
    count = request_tokens if num_tokens is None else check_count("num_tokens", num_tokens, request_tokens)
    rows = _block_table(block_table, layout)
    for gi, row in enumerate(rows):
        given = [b for b in row if b is not None]
        if len(given) == len(row) and len(set(given)) == len(given):
            continue  # the common case: a full table of distinct ids; the mask is not needed
        per_chunk = layout.groups[gi].blocks_per_chunk
        seen: dict = {}
        for chunk in store_chunk_indices(layout, gi, count):
            for logical in range(chunk * per_chunk, (chunk + 1) * per_chunk):
                if logical >= len(row):
                    break  # the engine names a short table itself
                block = row[logical]
                if block is None:
                    raise ValueError(f"block_table[{gi}][{logical}] is None, but the store reads logical block {logical}")
                if block in seen:
                    raise ValueError(
                        f"block_table[{gi}] gives device block {block} to logical blocks {seen[block]} and "
                        f"{logical}; each stored block needs its own device block"
                    )
                seen[block] = logical
    return count, rows


def check_load_arguments(
    layout: ModelLayout, request_tokens: int, hit_tokens: Any, block_table: Any
) -> Tuple[int, List[List[Optional[int]]]]:
    """``load``'s ``hit_tokens`` and ``block_table``, checked and normalised (``None`` stands for
    a block the hit does not restore)."""
    count = check_count("hit_tokens", hit_tokens, request_tokens)
    granularity = layout.hit_granularity_tokens
    if count % granularity:
        # lookup answers only multiples of it; any other length names no boundary the chunks end at.
        raise ValueError(f"hit_tokens must be a multiple of the layout's hit_granularity_tokens ({granularity}), got {count}")
    return count, _block_table(block_table, layout)


def _out_of_range(group_index: int, block: int, limit: int) -> DeviceError:
    return DeviceError(f"group {group_index}: device block {block} is out of range (the KV cache has {limit} blocks)")


def check_device_blocks(group_index: int, blocks: Sequence[int], limit: int) -> None:
    """Every block within the group's KV cache of ``limit`` blocks (``DeviceError``), checked before
    anything is scheduled, so a bad table is the caller's typed error, not a copy that fails later
    on a worker thread."""
    for block in blocks:
        if not 0 <= block < limit:
            raise _out_of_range(group_index, block, limit)


def valid_store_run(first_chunk: int, last_chunk: int, per_chunk: int, row: Sequence[Optional[int]],
                    limit: int) -> bool:
    """Whether every chunk of ``first_chunk..last_chunk`` plainly passes ``check_store_blocks``
    (the row reaches their end, no ``None``, every block in ``[0, limit)``): one check of the run
    in C calls. ``False`` at any doubt: the caller then checks chunk by chunk, which raises (or
    not) exactly as without this."""
    end = (last_chunk + 1) * per_chunk
    if first_chunk < 0 or len(row) < end:
        return False
    blocks = row[first_chunk * per_chunk : end]
    if not blocks or None in blocks:
        return False
    ints = cast(Sequence[int], blocks)
    return min(ints) >= 0 and max(ints) < limit


def check_store_blocks(group_index: int, chunk: int, per_chunk: int, row: Sequence[Optional[int]],
                       limit: int) -> List[int]:
    """The device blocks of one chunk a store copies (``row`` normalised by ``check_store_arguments``,
    which refused a ``None`` among them): the row must reach the chunk's end (``ValueError``) and
    each block lie in the KV cache (``DeviceError``). Checked only for the chunks a store copies."""
    first = chunk * per_chunk
    if len(row) < first + per_chunk:
        raise ValueError(
            f"block_table[{group_index}] has {len(row)} blocks; chunk {chunk} needs blocks "
            f"{first}..{first + per_chunk - 1}"
        )
    if None in row[first : first + per_chunk]:  # check_store_arguments refused these; kept for a direct caller
        raise ValueError(f"block_table[{group_index}] has no device block for a block of chunk {chunk}")
    blocks = cast(List[int], row[first : first + per_chunk])  # no None (above); rows normalised to ints
    if min(blocks) < 0 or max(blocks) >= limit:  # two C calls per chunk; the loop names the block
        check_device_blocks(group_index, blocks, limit)
    return blocks


def check_load_blocks(group_index: int, row: Sequence[Optional[int]], logical: Sequence[Optional[int]], limit: int,
                      seen: dict) -> List[Optional[int]]:
    """The device block of each logical block one chunk of a load restores (``None`` where it
    restores none): a restored block without a device block (missing, ``None`` or negative) is a
    ``ValueError``, one past the KV cache's ``limit`` blocks a ``DeviceError``, one given twice
    (``seen``, as for ``check_load_targets``) a ``ValueError``."""
    targets: List[Optional[int]] = []
    for block in logical:
        if block is None:
            targets.append(None)
            continue
        device_block = row[block] if block < len(row) else None
        if device_block is None or device_block < 0:
            raise ValueError(f"block_table[{group_index}] has no device block for logical block {block}")
        targets.append(int(device_block))
    for block in targets:  # none is negative: the loop above refused those
        if block is not None and block >= limit:
            raise _out_of_range(group_index, block, limit)
    check_load_targets(group_index, targets, seen, logical)
    return targets


def valid_load_plan_targets(row: Sequence[Optional[int]], plan: Sequence[Tuple[int, Sequence[Optional[int]]]],
                            limit: int) -> Optional[List[List[Optional[int]]]]:
    """Per (chunk, logical blocks) of a group's load ``plan``, its device blocks, when the whole plan
    plainly passes ``check_load_blocks``: no block left out, each restored block's device block
    in the table, in ``[0, limit)`` and given to no other. ``None`` at any doubt: the caller then
    runs ``check_load_blocks`` chunk by chunk, which raises (or not) exactly as without this.
    Checks the group's blocks at once in C calls instead of a few Python steps per block."""
    maybe_logical = [block for _, blocks in plan for block in blocks]
    if not maybe_logical or None in maybe_logical:
        return None
    logical = cast(List[int], maybe_logical)
    if max(logical) >= len(row) or min(logical) < 0:
        return None
    maybe_found = [row[block] for block in logical]
    if None in maybe_found:
        return None
    found = cast(List[int], maybe_found)
    if min(found) < 0 or max(found) >= limit or len(set(found)) != len(found):
        return None
    targets: List[List[Optional[int]]] = []
    at = 0
    for _, blocks in plan:
        targets.append(maybe_found[at : at + len(blocks)])
        at += len(blocks)
    return targets


def check_load_targets(group_index: int, targets: Sequence[Optional[int]], seen: dict, logical: Sequence[Optional[int]]) -> None:
    """One device block per restored logical block of a group: ``seen`` (device block -> logical
    block, per group, kept by the caller across the load's chunks) refuses a device block given
    twice (``ValueError``), which would leave one of the two logical blocks holding the other's KV."""
    for block, device_block in zip(logical, targets):
        if device_block is None:
            continue
        if device_block in seen:
            raise ValueError(
                f"block_table[{group_index}] gives device block {device_block} to logical blocks {seen[device_block]} "
                f"and {block}; each restored block needs its own device block"
            )
        seen[device_block] = block


def check_fence_arguments(block_ids: Any, group_index: Any, num_blocks: Sequence[int]) -> Tuple[range, List[int]]:
    """``fence``'s arguments by the rules of a block table's: device block ids are ints (``TypeError``
    naming the index) within the KV cache (``DeviceError``), ``group_index`` None or a group's index.
    Returns the groups and the block ids."""
    groups = len(num_blocks)
    if group_index is not None:
        index = _as_int(group_index, "group_index")
        if not 0 <= index < groups:
            raise ValueError(f"group_index must be None or in [0, {groups}), got {index}")
        chosen = range(index, index + 1)
    else:
        chosen = range(groups)
    if hasattr(block_ids, "__next__") or isinstance(block_ids, (set, frozenset)):
        block_ids = list(block_ids)  # order does not matter to a fence: an iterator or a set is fine
    blocks = _int_list(block_ids, "block_ids", allow_none=False)
    limit = max(num_blocks[g] for g in chosen)
    for position, block in enumerate(blocks):
        if not 0 <= block < limit:
            where = f"group {chosen[0]}'s KV cache has" if len(chosen) == 1 else "the largest group's KV cache has"
            raise DeviceError(f"block_ids[{position}]: device block {block} is out of range ({where} {limit} blocks)")
    return chosen, blocks


def check_timeout(name: str, value: Any) -> Optional[float]:
    """A wait in seconds: ``None``, or a positive finite int or float (not a bool, not a string)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds, got {_describe(value)}")
    seconds = float(value)
    if not 0.0 < seconds < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return seconds


PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def check_prefetch_policy(policy: Any, timeout_s: Any) -> Optional[float]:
    """``prefetch``'s ``policy`` (one of ``PREFETCH_POLICIES``) and ``timeout_s`` (as for
    ``check_timeout``; ``policy="timeout"`` needs one). Returns the timeout in seconds."""
    if not isinstance(policy, str) or policy not in PREFETCH_POLICIES:
        raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {policy!r}")
    seconds = check_timeout("timeout_s", timeout_s)
    if policy == "timeout" and seconds is None:
        raise ValueError(f"policy 'timeout' needs a positive timeout_s, got {seconds!r}")
    return seconds


def check_engine_settings(config: Any, layout: ModelLayout, device: Any) -> None:
    """Settings that only make sense against the layout and the machine, checked when the engine
    is built: a ``cache_dir`` whose parent does not exist and a host pool larger than the machine's
    memory are ``ValueError``; a pool smaller than four chunks per group is raised to that floor,
    and the log says so."""
    if config.cache_dir is not None:
        cache_dir = os.path.abspath(os.path.expanduser(config.cache_dir))
        parent = os.path.dirname(cache_dir)
        if not os.path.exists(cache_dir) and not os.path.isdir(parent):
            # Only the last component is made: a missing parent is most often a disk that is not
            # mounted, and a cache created on the root filesystem instead would fill it.
            raise ValueError(
                f"cache_dir {config.cache_dir!r}: its parent {parent} does not exist (kvtier creates only "
                "the last component; mount or create the parent first)"
            )
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except Exception:  # no psutil or no /proc: nothing to compare with
        total = None
    if total is not None and config.host_capacity_bytes > total:
        raise ValueError(
            f"host_capacity_bytes={config.host_capacity_bytes} is more than this machine's memory "
            f"({total} bytes); the host pool is allocated up front"
        )
    floor = sum(4 * device.chunk_nbytes(g) for g in range(len(layout.groups)))
    if config.host_capacity_bytes < floor:
        logger.warning(
            "host_capacity_bytes=%d holds fewer than 4 chunks per group; using the floor of 4 slots per "
            "group (%d bytes): a store needing more slots of one group than that is dropped",
            config.host_capacity_bytes, floor,
        )


def check_device_kind(configured: Optional[str], view: Any) -> str:
    """The host pool's device kind: the view's. A configured ``device_kind`` only asserts it (a
    CUDA view with a "cpu" pool would make every copy synchronous, silently)."""
    kind = view.backend.kind
    if configured not in (None, kind):
        raise DeviceError(
            f"config.device_kind is {configured!r} but the KV tensors are on {view.device}; "
            "leave device_kind unset to follow the view"
        )
    return kind


def check_pools_pinned(view: Any, pools: Sequence[Any]) -> None:
    """On CUDA every host pool must be page-locked; closes them and raises ``DeviceError`` if not."""
    if view.backend.is_cuda and not all(pool.pinned for pool in pools):
        for pool in pools:
            pool.close()
        raise DeviceError("the host pool is not page-locked but the KV tensors are on CUDA: every copy would be "
                          "synchronous; refusing to start")
