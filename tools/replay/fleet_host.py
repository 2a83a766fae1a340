"""One host of ``kvtier replay --fleet``: an engine process the fleet driver (``fleet.py``) steps.

Run as ``python -m kvtier.tools.replay.fleet_host CONFIG_JSON``; it reads one JSON command per line
on stdin and answers each with one JSON line on stdout (nothing else is written there; logs go to
stderr). Commands: ``{"op": "step", "request": r, "refresh": bool, "corrupt": bool}`` replays
request ``r`` of the trace; ``{"op": "disk_faults", "on": bool}`` starts or heals I/O errors under
this host's LMDB tier (``tools.testing.faults.inject_io_faults``: every read, put and commit fails
with EIO); ``{"op": "close"}`` closes the engine, checks it and answers its statistics.

A step, on the host's own event loop: refresh the disk index (``refresh``: chunks other hosts
wrote to the shared remote since the last step become hits) -> record where each of the request's
chunks is right before the lookup (this host's host tier, its LMDB, the remote: the ground truth
a miss is classified against) -> ``lookup`` -> ``load`` -> every loaded byte compared with the
bytes its key stands for (``engine_mode.chunk_bytes_of_key``; one wrong byte ends the host with
exit 1) -> prefill and ``store`` -> ``flush`` of the engine and of the chain, so the write-behind
to the remote has landed before the driver starts the next step. ``corrupt``: one chunk the lookup
admitted that only the remote holds gets its record's last byte flipped on the server
(a raw ``GET``/``SET`` beside the tier) between the lookup that admitted it and the load, so the
load must find it corrupt.

The answer names, per request: the hit, whether the load succeeded, each missed chunk (from the
hit's end to the last chunk a lookup may hit) with its three locations, the chunks this request
stored and whether they all reached the disk, the chunks that left this host's host tier and
LMDB during the step (with the LMDB's reason) and the remote write failures counted during the step.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.errors import EngineInvariantError, KvtierError
from kvtier.policy import cdiv, layout_fingerprint
from kvtier.policy.plan import load_block_plan
from kvtier.tiers.base import Removal
from kvtier.tiers.chain import ChainedTier, tier_statistics_dict
from kvtier.tiers.device import DeviceKVView

from .engine_mode import EngineReplayError, _request_tokens, _sized_pools, chunk_bytes_of_key, policy_options
from .layouts import resolve_layout
from .trace import read_trace
from .workload import scaled_layout

__all__ = ["FleetHost", "main"]


class FleetHost:
    """One engine over its own host pools and cache directory, optionally chained to the shared
    remote; ``step`` replays one request (module docstring). Event-loop thread only."""

    def __init__(self, config: Dict[str, Any]) -> None:
        self.config = config
        self.trace = read_trace(config["trace"], format=config.get("format")).limited(
            config.get("limit"), config.get("max_input_tokens"))
        self.layout = scaled_layout(resolve_layout(config.get("layout")), config["bytes_scale"])
        model = self.layout.layout
        if len(model.groups) != 1:
            raise ValueError("--fleet replays a layout of one attention group (the default full-attention one)")
        self.group = model.groups[0]
        self.chunk_bytes = self.layout.all_chunk_bytes[0]
        block_bytes = self.layout.block_bytes[0]
        max_tokens = max(r.input_length for r in self.trace.requests)
        self.cache = torch.zeros(cdiv(max_tokens, self.group.block_size) + 1, block_bytes, dtype=torch.uint8)
        self.array = self.cache.numpy()
        self.device = DeviceKVView(model, [[self.cache]])
        self.fingerprint = layout_fingerprint(model, model=f"kvtier-replay:{self.layout.name}", dtype="uint8",
                                              shapes=[(block_bytes,)], weights_version="replay-1")
        self.engine: Optional[OffloadEngine] = None
        self.lmdb: Any = None
        self.remote: Any = None
        self.lmdb_removed: List[Removal] = []
        self.disk_plan: Any = None
        self.verified = 0

    async def start(self) -> None:
        c = self.config
        options: Dict[str, Any] = dict(
            host_capacity_bytes=c["host_slots"] * self.chunk_bytes, events_max=1 << 20,
            store_retention_interval_tokens=c.get("retention"), cache_dir=c["cache_dir"],
            **policy_options(c["policy"]),
            disk_capacity_bytes=c["disk_bytes"], lmdb_map_size_bytes=max(1 << 30, 4 * c["disk_bytes"]))
        if c.get("remote_url"):
            options.update(remote_url=c["remote_url"], remote_namespace=c["namespace"],
                           remote_timeout_s=c["remote_timeout_s"], remote_connect_timeout_s=c["remote_timeout_s"],
                           remote_breaker_reset_s=c["remote_timeout_s"] * 2)
        engine = OffloadEngine(self.layout.layout, self.device, EngineConfig(**options), fingerprint=self.fingerprint,
                               host_pools=_sized_pools([c["host_slots"]]))
        await engine.start()
        self.engine = engine
        tier = engine.disk_tier
        if isinstance(tier, ChainedTier):
            self.lmdb, self.remote = tier.tiers[0], tier.tiers[1]
        else:
            self.lmdb = tier
        self.lmdb.subscribe_removals(self.lmdb_removed.extend)
        engine.take_events()

    async def _where(self, keys: Sequence[bytes]) -> Dict[str, List[Optional[bool]]]:
        """Each key's presence on this host's host tier, its LMDB and the remote (``None``: the
        tier could not say, an error)."""
        assert self.engine is not None
        entries = self.engine.host.entries
        where: Dict[str, List[Optional[bool]]] = {"h": [k in entries for k in keys]}
        for name, tier in (("d", self.lmdb), ("r", self.remote)):
            if tier is None:
                where[name] = [False] * len(keys)
                continue
            try:
                where[name] = [bool(x) for x in await tier.contains_many(list(keys))]
            except (KvtierError, OSError):
                where[name] = [None] * len(keys)
        return where

    async def _corrupt_one(self, keys: Sequence[bytes], where: Dict[str, List[Optional[bool]]]) -> Optional[bytes]:
        """Flip the last byte of the first of ``keys`` this host would read from the remote."""
        for i, key in enumerate(keys):
            if where["r"][i] and not where["h"][i] and not where["d"][i]:
                from kvtier.tools.testing.valkey import corrupt_remote_record

                if await asyncio.get_running_loop().run_in_executor(
                        None, corrupt_remote_record, self.config["remote_url"], self.remote.rkey(key)):
                    return key
        return None

    def _stats(self) -> Dict[str, float]:
        assert self.engine is not None
        tier = self.engine.disk_tier
        return tier_statistics_dict(tier) if tier is not None else {}

    async def step(self, r: int, refresh: bool, corrupt: bool) -> Dict[str, Any]:
        engine = self.engine
        assert engine is not None
        began = time.perf_counter()
        out: Dict[str, Any] = {"request": r, "refresh_failed": False}
        if refresh and self.remote is not None:
            try:
                await engine.refresh_disk_index()
                out["refreshed"] = True
            except KvtierError:
                out["refresh_failed"] = True
        before = self._stats()
        n = self.trace.requests[r].input_length
        tokens = _request_tokens(self.trace, r)
        keys = engine.request_keys(tokens)
        chunk_keys = keys.keys[0]
        tpc = self.group.tokens_per_chunk
        hittable = (n - 1) // tpc  # a lookup never covers the prompt's last token
        where = await self._where(chunk_keys[:hittable])
        hit = engine.lookup(keys)
        if hit is None:
            await engine.flush()
            hit = engine.lookup(keys) or 0
        if corrupt and self.remote is not None:
            # A chunk the lookup admitted that only the remote holds: the load must read it.
            bad = await self._corrupt_one(chunk_keys[:hit // tpc], where)
            out["corrupted"] = bad.hex() if bad is not None else None
        table = [list(range(cdiv(n, self.group.block_size)))]
        ok = True
        reason = None
        if hit:
            result = await engine.load(keys, hit, table)
            ok, reason = result.ok, result.reason
            if ok:
                self._verify(r, chunk_keys, hit)
        hit_tokens = hit if ok else 0
        first = hit_tokens // tpc
        out.update(n=n, hit=hit_tokens, looked_up=hit, ok=ok, reason=reason,
                   missed=[k.hex() for k in chunk_keys[first:hittable]],
                   where={name: flags[first:] for name, flags in where.items()})
        per_chunk, bb = self.group.blocks_per_chunk, self.layout.block_bytes[0]
        for c in range(n // tpc):
            self.array[c * per_chunk:(c + 1) * per_chunk] = chunk_bytes_of_key(
                chunk_keys[c], self.chunk_bytes).reshape(per_chunk, bb)
        handle = engine.store(keys, table)
        await handle.wait_released()
        await engine.flush()
        tier = engine.disk_tier
        try:
            if tier is not None:
                await tier.flush()
        except KvtierError as exc:  # I/O errors under the LMDB tier: its access-time writes fail
            out["flush_failed"] = str(exc)
        out["stored"] = [chunk_keys[c].hex() for _, c in handle.scheduled]
        # False: some of them never reached the disk (a batch the LMDB refused, an I/O error), so
        # the chain wrote them to no lower tier either: they live on this host's host tier only.
        out["durable"] = await handle.wait_durable() if handle.scheduled else True
        out["host_removed"] = [e.key.hex() for e in engine.take_events() if e.tier == "host" and e.kind == "removed"]
        removed, self.lmdb_removed[:] = list(self.lmdb_removed), []
        out["disk_removed"] = [[x.key.hex(), x.reason] for x in removed]
        after = self._stats()
        out["remote_write_failures"] = sum(after.get(name, 0) - before.get(name, 0)
                                           for name in ("writebehind_failed", "remote.errors"))
        out["seconds"] = time.perf_counter() - began
        return out

    def _verify(self, r: int, chunk_keys: Sequence[bytes], hit: int) -> None:
        bb = self.layout.block_bytes[0]
        for c, block_list in load_block_plan(self.layout.layout, 0, hit):
            expected = chunk_bytes_of_key(chunk_keys[c], self.chunk_bytes).reshape(-1, bb)
            for j, block in enumerate(block_list):
                if block is not None and not np.array_equal(self.array[block], expected[j]):
                    wrong = int(np.count_nonzero(self.array[block] != expected[j]))
                    raise EngineReplayError(f"request {r}: chunk {c} block {block}: {wrong} of {bb} loaded bytes "
                                            "differ from what the chunk's key stands for")
            self.verified += 1

    def disk_faults(self, on: bool) -> Dict[str, Any]:
        from kvtier.tools.testing.faults import inject_io_faults, remove_io_faults

        if on:
            self.disk_plan = inject_io_faults(self.lmdb, fail_from=1)
            return {"disk_faults": True}
        remove_io_faults(self.lmdb)
        faults = self.disk_plan.faults if self.disk_plan is not None else 0
        return {"disk_faults": False, "injected": faults}

    async def close(self) -> Dict[str, Any]:
        engine = self.engine
        assert engine is not None
        stats = self._stats()
        engine.check()
        try:
            await engine.check_disk()
            problems = None
        except EngineInvariantError as exc:  # answered, so the driver reports every host's problems
            problems = str(exc)
        await engine.close()
        return {"closed": True, "verified": self.verified, "wrong_bytes": 0, "check_disk": problems,
                "tier": {k: v for k, v in stats.items() if v}}


async def _serve(config: Dict[str, Any]) -> int:
    host = FleetHost(config)
    await host.start()
    loop = asyncio.get_running_loop()
    answer = {"ready": True, "rkey_prefix": host.remote.rkey(b"\0" * 32)[:-64].decode() if host.remote else None}
    print(json.dumps(answer), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            await host.close()
            return 0
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "step":
                reply = await host.step(command["request"], command.get("refresh", False), command.get("corrupt", False))
            elif op == "disk_faults":
                reply = host.disk_faults(command["on"])
            elif op == "close":
                print(json.dumps(await host.close()), flush=True)
                return 0
            else:
                raise ValueError(f"unknown fleet host command {op!r}")
        except EngineReplayError as exc:
            print(json.dumps({"wrong_bytes": str(exc)}), flush=True)
            return 1
        print(json.dumps(reply), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        config = json.load(f)
    return asyncio.run(_serve(config))


if __name__ == "__main__":
    sys.exit(main())
