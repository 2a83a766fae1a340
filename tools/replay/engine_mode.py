"""Engine mode of ``kvtier replay``: the trace through a real ``OffloadEngine``, every loaded byte checked.

Primitives: ``replay_engine`` (async; returns an ``Outcome``), ``chunk_bytes_of_key``. Runs on the
caller's event loop; copies and disk I/O run on the engine's threads.

Per request, in trace order: ``lookup`` -> ``load`` of the hit into the request's device blocks ->
``flush`` (the disk writes the load handed to the spill land before the store is planned) ->
every restored block compared with the bytes its key stands for -> the rest counts as prefilled:
the prompt's blocks are filled with their keys' bytes -> ``store`` of the prompt (the engine picks
exactly the chunks the coverage contract and the retention interval store) -> ``flush``, so the
next request sees every copy and spill settled, as the fast mode assumes.

A chunk's KV bytes are a function of its key (as a real model's KV is a function of the prefix):
BLAKE3's extendable output of the key. Any run that stored a chunk, this one or an earlier one on
the same ``--cache-dir``, wrote the same bytes, so the check needs no memory of what was stored.
Which tier served a chunk is read from the engine's own events (``take_events``): a chunk that
arrives on the host during a load was promoted from disk; the rest of the load came from the host.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import blake3
import numpy as np
import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.engine.config import EVICTION_POLICIES
from kvtier.errors import EngineInvariantError
from kvtier.policy import cdiv, layout_fingerprint
from kvtier.policy.plan import load_block_plan
from kvtier.tiers.device import DeviceKVView
from kvtier.tiers.host import HostSlabPool

from .layouts import ReplayLayout
from .sim import Outcome, TierCounts, _step, split_policy
from .trace import Trace, block_tokens

__all__ = ["replay_engine", "chunk_bytes_of_key", "EngineReplayError"]


class EngineReplayError(EngineInvariantError):
    """A loaded byte differed from what its key stands for: kvtier broke its promise (the command
    exits 1), never the user's mistake."""


def chunk_bytes_of_key(key: bytes, nbytes: int) -> np.ndarray:
    """The ``nbytes`` KV bytes a chunk with ``key`` holds in a replay."""
    return np.frombuffer(blake3.blake3(key).digest(length=nbytes), dtype=np.uint8)


def _sized_pools(host_slots: List[int]) -> Callable[..., List[HostSlabPool]]:
    """An ``OffloadEngine(host_pools=...)`` factory of pools holding ``host_slots[g]`` chunks: those
    the true (unscaled) chunk sizes give for the host budget (``tiers.host.pools_for_budget``), so
    that ``--bytes-scale`` shrinks the slots' bytes without changing how many chunks the host holds
    (page padding of large slots, which the split counts, would otherwise change with the scale)."""
    slots = list(host_slots)

    def make(chunk_bytes: List[int], *, device_kind: str, eviction: str) -> List[HostSlabPool]:
        return [HostSlabPool(nbytes, count, device_kind=device_kind, eviction=eviction)
                for nbytes, count in zip(chunk_bytes, slots)]

    return make


def policy_options(policy: str) -> Dict[str, str]:
    """The engine settings ``--policy NAME`` stands for: the host pools' eviction, the disk tier's
    where the disk has that policy (ARC exists for the host alone; the disk keeps LRU), and the
    disk admission (``NAME+seen``: ``seen``; else ``all``)."""
    eviction, admission = split_policy(policy)
    return dict(eviction_policy=eviction if eviction in EVICTION_POLICIES else "lru",
                host_eviction_policy=eviction, disk_admission=admission)


def _request_tokens(trace: Trace, index: int) -> List[int]:
    request = trace.requests[index]
    if request.token_ids is not None:
        return request.token_ids.tolist()
    if request.block_ids is None:
        raise ValueError(f"request {request.index} has neither block_ids nor token_ids")
    return block_tokens(request.block_ids, request.input_length, trace.block_tokens).tolist()


async def replay_engine(
    trace: Trace,
    layout: ReplayLayout,
    *,
    host_slots: List[int],
    disk_bytes: Optional[int],
    cache_dir: Optional[str],
    retention_interval: Optional[int],
    policy: str = "lru",
    remote_url: Optional[str] = None,
    progress: Optional[Callable[[int], None]] = None,
    steps: Optional[list] = None,
) -> Outcome:
    """Replay ``trace`` through an engine whose host pools hold ``host_slots[g]`` chunks and, with
    ``cache_dir``, an LMDB tier of ``disk_bytes`` record bytes (``None``: unbounded). Bytes are
    reported at the model's true chunk sizes (``layout.full_chunk_bytes``). Raises
    ``EngineReplayError`` at the first wrong byte. ``steps``: as ``simulate_engine``'s."""
    model = layout.layout
    groups = model.groups
    num_groups = len(groups)
    chunk_bytes = layout.all_chunk_bytes
    true_bytes = [layout.full_chunk_bytes(g) for g in range(num_groups)]
    max_tokens = max(r.input_length for r in trace.requests)
    blocks = [cdiv(max_tokens, g.block_size) + 1 for g in groups]
    caches = [[torch.zeros(blocks[g], layout.block_bytes[g], dtype=torch.uint8)] for g in range(num_groups)]
    device = DeviceKVView(model, caches)
    arrays = [caches[g][0].numpy() for g in range(num_groups)]
    fingerprint = layout_fingerprint(model, model=f"kvtier-replay:{layout.name}", dtype="uint8",
                                     shapes=[(b,) for b in layout.block_bytes], weights_version="replay-1")
    host_bytes = sum(n * size for n, size in zip(host_slots, chunk_bytes))
    options: Dict[str, Any] = dict(host_capacity_bytes=host_bytes, store_retention_interval_tokens=retention_interval,
                                      events_max=1 << 20, **policy_options(policy))
    if cache_dir is not None:
        options.update(cache_dir=cache_dir, disk_capacity_bytes=disk_bytes,
                       lmdb_map_size_bytes=max(1 << 30, 4 * (disk_bytes or 0)))
    if remote_url is not None:
        options.update(remote_url=remote_url)
    config = EngineConfig(**options)

    n_req = len(trace)
    hits = np.zeros(n_req, dtype=np.int64)
    read = {"host": np.zeros(n_req, dtype=np.int64)}
    if cache_dir is not None:
        read["disk"] = np.zeros(n_req, dtype=np.int64)
    if remote_url is not None:
        read["remote"] = np.zeros(n_req, dtype=np.int64)
    stored = np.zeros(n_req, dtype=np.int64)
    tiers = {name: TierCounts() for name in read if name != "remote"}
    disk_group: Dict[bytes, int] = {}  # the group of each chunk on disk (its removal event has none)
    verified = 0
    failed_loads = 0
    ops = 0
    started = time.perf_counter()

    def take_events(engine: OffloadEngine) -> List[int]:
        """Book the engine's events; the groups of the chunks that came to the host."""
        arrived: List[int] = []
        for event in engine.take_events():
            counts = tiers.get(event.tier)
            if counts is None:
                continue
            group = event.group_index if event.group_index >= 0 else disk_group.get(event.key, -1)
            size = true_bytes[group] if group >= 0 else 0
            if event.kind == "stored":
                counts.stored_chunks += 1
                counts.stored_bytes += size
                if event.tier == "host":
                    arrived.append(group)
                else:
                    disk_group[event.key] = group
            elif event.kind == "removed":
                counts.evicted_chunks += 1
                counts.evicted_bytes += size
                if event.tier == "disk":
                    disk_group.pop(event.key, None)
        return arrived

    def remote_hits(engine: OffloadEngine) -> float:
        from kvtier.tiers.chain import tier_statistics_dict

        tier = engine.disk_tier
        return float(tier_statistics_dict(tier).get("hits.remote", 0.0)) if tier is not None else 0.0

    seen_remote = [0.0]
    async with OffloadEngine(model, device, config, fingerprint=fingerprint,
                             host_pools=_sized_pools(host_slots)) as engine:
        # The LMDB tier applies a load's uses (disk reads, and host hits it also holds) to its LRU
        # at its next write or on a timer; applying them after every load makes the moment they
        # land a function of the trace, as in the fast mode (each use touches at once).
        disk_tier = engine.disk_tier
        take_events(engine)  # chunks an earlier run left are on disk, not on the host
        for r in range(n_req):
            n = trace.requests[r].input_length
            keys = engine.request_keys(_request_tokens(trace, r))
            table = [list(range(cdiv(n, g.block_size))) for g in groups]
            hit = engine.lookup(keys)
            ops += 1
            if hit is None:  # cannot happen after a flush; ask again as a serving process would
                await engine.flush()
                hit = engine.lookup(keys) or 0
            if hit:
                plans = [load_block_plan(model, g, hit) for g in range(num_groups)]
                result = await engine.load(keys, hit, table)
                ops += 1
                # Chunks that came to the host during the load were promoted from disk (a chunk
                # an earlier window of the load evicted comes back that way too).
                promoted = take_events(engine)
                # The host-only chunks the load hit are on their way to the disk, and the disk
                # evictions that make room for them decide which of the prompt's chunks the store
                # finds gone: the store waits for them, as the fast mode writes them first.
                await engine.flush()
                if disk_tier is not None:
                    await disk_tier.flush()
                if remote_url is not None and promoted:
                    # The chain counts its hits per tier; the remote's share of this load's reads
                    # moves from the disk column to the remote one (by chunk count).
                    now = remote_hits(engine)
                    share = min(1.0, (now - seen_remote[0]) / len(promoted))
                    seen_remote[0] = now
                    moved = int(round(share * sum(true_bytes[g] for g in promoted)))
                    read["remote"][r] += moved
                    read["disk"][r] -= moved
                for g in promoted:
                    read["disk"][r] += true_bytes[g]
                    tiers["disk"].read_chunks += 1
                    tiers["disk"].read_bytes += true_bytes[g]
                if result.ok:
                    hits[r] = hit
                    for g in range(num_groups):
                        bb = layout.block_bytes[g]
                        for c, block_list in plans[g]:
                            expected = chunk_bytes_of_key(keys.keys[g][c], chunk_bytes[g]).reshape(-1, bb)
                            for j, block in enumerate(block_list):
                                if block is not None and not np.array_equal(arrays[g][block], expected[j]):
                                    wrong = int(np.count_nonzero(arrays[g][block] != expected[j]))
                                    raise EngineReplayError(
                                        f"request {r}: group {g} chunk {c} block {block}: {wrong} of {bb} loaded "
                                        "bytes differ from what the chunk's key stands for")
                            verified += 1
                    from_host = sum(true_bytes[g] * len(plans[g]) for g in range(num_groups)) - sum(
                        true_bytes[g] for g in promoted)
                    read["host"][r] += from_host
                    tiers["host"].read_bytes += from_host
                    tiers["host"].read_chunks += sum(len(p) for p in plans) - len(promoted)
                else:
                    failed_loads += 1
            # The rest is prefilled: every complete chunk holds its key's bytes.
            for g, group in enumerate(groups):
                per_chunk, bb = group.blocks_per_chunk, layout.block_bytes[g]
                for c in range(n // group.tokens_per_chunk):
                    arrays[g][c * per_chunk:(c + 1) * per_chunk] = chunk_bytes_of_key(
                        keys.keys[g][c], chunk_bytes[g]).reshape(per_chunk, bb)
            handle = engine.store(keys, table)
            ops += 1
            await handle.wait_released()
            stored[r] = sum(true_bytes[g] for g, _ in handle.scheduled)
            await engine.flush()
            take_events(engine)
            if progress is not None:
                progress(1)
            if steps is not None:
                steps.append(_step(hits[r], tiers))
        stats = engine.statistics()
        engine.check()
        await engine.check_disk()
    seconds = time.perf_counter() - started
    dropped = {k: int(v) for k, v in (stats.get("dropped") or {}).items() if v}
    return Outcome("engine", hits, np.asarray([r.input_length for r in trace.requests], dtype=np.int64), read,
                   stored, tiers, dropped, {"chunks_verified": verified, "wrong_bytes": 0,
                                            "failed_loads": failed_loads, "engine_ops": ops,
                                            "engine_seconds": seconds})
