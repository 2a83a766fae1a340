"""Fault suite, I/O error at call N: a shim under the LMDB tier and under the file tier
(``kvtier.tools.testing.faults.inject_io_faults``) fails the Nth low-level operation -- LMDB: a record put,
a transaction commit, a read transaction; files: mkdir, open, write, fsync, rename, directory fsync,
read, remove -- once, or from then on, for N = 1, 2, ... until the engine workload (produce three
prompts, load one back, restart, load all three) completes without reaching call N.

After every N: nothing but kvtier's typed errors escaped (none reach the engine's caller: stores
and loads report failure as values), ``engine.check()`` passes at the end of each phase (no chunk
PENDING or LOADING, pins balanced, slots accounted for), the statistics agree with each other,
every load that said ok restored the producer's bytes bitwise, and once the fault clears a fresh
engine loads every prompt whose store was acknowledged durable, stores a new one, and both tiers'
self-checks pass.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.base import NO_IO_HOOK, ChunkTier
from kvtier.tiers.files import FileTier
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tools.testing.faults import (
    FILE_IO_OPS,
    LMDB_IO_OPS,
    FaultyTier,
    IOFaultPlan,
    inject_io_faults,
    remove_io_faults,
)
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device
from kvtier.tools.testing.tier_seam import SeamTier

LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))  # R = 0
FINGERPRINT = b"fault-suite-io"
PROMPTS = 3
HIT = 32  # a 33-token prompt + 1 token hits 32


def engine_config() -> EngineConfig:
    # No cache_dir: the test opens the tier itself (to put the shim under it) and passes it in.
    # host_capacity_bytes=1 leaves the floor of 4 slots per group, so chunks leave the host and
    # loads in the first phase already read the disk.
    return EngineConfig(
        host_capacity_bytes=1,
        pressure_poll_interval_s=3600.0,
        tier_timeout_s=10.0,
        spill_batch_max_chunks=4,
    )


async def open_tier(kind: str, path: Path) -> ChunkTier:
    if kind == "lmdb":
        return await LmdbTier.open(path, map_size_bytes=1 << 20)
    return await FileTier.open(path, io_threads=2)


class RecordingTier(FaultyTier):
    """Injects nothing itself: records each put batch's keys and whether it was acknowledged."""

    def __init__(self, inner: ChunkTier, log: List[Tuple[List[bytes], bool]]) -> None:
        super().__init__(inner)
        self.log = log

    async def put_many(self, items) -> None:
        keys = [bytes(k) for k, _, _ in items]
        try:
            await super().put_many(items)
        except BaseException:
            self.log.append((keys, False))
            raise
        self.log.append((keys, True))


@dataclass
class Phase:
    """What one engine life did."""

    durable: Dict[int, bool] = field(default_factory=dict)  # prompt -> store acknowledged durable
    loads: List[Tuple[int, Optional[int], Optional[str]]] = field(default_factory=list)  # prompt, hit, failure


def check_statistics(engine: OffloadEngine, phase: str) -> None:
    stats = engine.statistics()
    where = f"{phase}: {stats}"
    assert stats["chunks_by_state"]["pending"] == 0 and stats["chunks_by_state"]["loading"] == 0, where
    assert stats["inflight_stores"] == 0 and stats["spill_queue"] == 0, where
    stored = stats["stored_chunks"]
    # Every chunk copied to the host was spilled exactly once: it landed or its batch failed.
    assert stored.get("host", 0) == stored.get("disk", 0) + stats["dropped"].get("tier_error", 0), where
    # The engine's disk index only names chunks it stored or found at start.
    assert stats["chunks_on_disk"] <= (stats["disk"] or {}).get("records", stats["chunks_on_disk"]), where


async def consume(engine: OffloadEngine, scenario: OffloadScenario, tokens: Sequence[int]) -> Tuple[Optional[int], Optional[str]]:
    """Lookup and load; a failed load is allowed (the serving process recomputes), wrong bytes are not."""
    keys = engine.request_keys(list(tokens))
    hit = engine.lookup(keys)
    assert hit is not None, "nothing is in flight between steps, so lookup never says 'ask again'"
    if not hit:
        return 0, None
    table = scenario.allocate(len(tokens))
    result = await engine.load(keys, hit, table)
    if result.ok:
        loaded: Dict[int, set] = {g: set() for g in range(len(LAYOUT.groups))}
        for g, block in result.loaded:
            loaded[g].add(block)
        scenario._check_bytes(keys, table, loaded)  # bitwise against the producer's bytes
    scenario.free(table)
    return hit, (None if result.ok else result.reason)


async def engine_life(kind: str, path: Path, plan: IOFaultPlan, body, batches: Optional[list] = None) -> None:
    tier = await open_tier(kind, path)
    inject_io_faults(tier, plan)
    disk = RecordingTier(tier, batches if batches is not None else [])
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT, num_blocks=64, num_layers=1, kv_heads=1, head_dim=4),
                           engine_config(), fingerprint=FINGERPRINT, disk_tier=disk, pressure_sources={})
    await engine.start()
    try:
        await body(engine)
        await engine.flush()
        engine.check()
    finally:
        await engine.close()
        await tier.close()


async def failed_batches_visible(kind: str, mode: str, tier: ChunkTier, batches) -> int:
    """A put batch that failed is all or nothing: none of its records exists (checked after a
    restart, so a record left on disk but not indexed counts too). The file tier's one documented
    exception: when the fault outlives the batch, its rollback's own removes fail and leave valid
    records, which the next open indexes. Returns how many such records are visible."""
    visible = 0
    for keys, ok in batches:
        if not ok:
            present = await tier.contains_many(keys)
            if not (kind == "files" and mode == "forever"):
                assert not any(present), f"a failed batch is partly visible: {sum(present)} of {len(keys)} records"
            visible += sum(present)
    return visible


async def workload(kind: str, path: Path, plan: IOFaultPlan, seed: int, mode: str) -> Tuple[Phase, Phase, dict]:
    """Produce PROMPTS prompts and load one back; restart; load all. Returns both phases and the
    producer's bytes (by key) for the check after healing."""
    first, second = Phase(), Phase()
    shared: dict = {"batches": []}

    async def produce_phase(engine: OffloadEngine) -> None:
        scenario = OffloadScenario(engine, seed=seed)
        prompts = [scenario.tokens(33) for _ in range(PROMPTS)]
        shared["prompts"] = prompts
        for i, prompt in enumerate(prompts):
            record = await scenario.produce(prompt)
            first.durable[i] = record.durable
            # A failed batch resolves the handle while the prompt's other batch may still spill
            # (its slots pinned): wait, so the next store is not dropped for want of slots.
            await engine.flush()
            assert not record.dropped[0] and not record.dropped[1], record
        shared["bytes"] = scenario.producer_bytes
        hit, failure = await consume(engine, scenario, prompts[0] + [1])
        first.loads.append((0, hit, failure))
        await engine.flush()
        check_statistics(engine, "first life")

    async def consume_phase(engine: OffloadEngine) -> None:
        scenario = OffloadScenario(engine, seed=seed + 1)
        scenario.producer_bytes = shared["bytes"]
        for i, prompt in enumerate(shared["prompts"]):
            hit, failure = await consume(engine, scenario, prompt + [1])
            second.loads.append((i, hit, failure))
        await engine.flush()
        check_statistics(engine, "second life")

    await engine_life(kind, path, plan, produce_phase, shared["batches"])
    await engine_life(kind, path, plan, consume_phase)
    return first, second, shared


async def after_healing(
    kind: str, path: Path, plan: IOFaultPlan, first: Phase, shared: dict, seed: int, mode: str
) -> int:
    """The fault has cleared: every acknowledged prompt loads whole and bitwise, a new one stores."""
    plan.heal()

    async def body(engine: OffloadEngine) -> None:
        orphans.append(await failed_batches_visible(kind, mode, engine.disk_tier, shared["batches"]))
        scenario = OffloadScenario(engine, seed=seed + 2)
        scenario.producer_bytes = dict(shared["bytes"])
        for i, prompt in enumerate(shared["prompts"]):
            hit, failure = await consume(engine, scenario, prompt + [1])
            if first.durable.get(i):
                assert (hit, failure) == (HIT, None), f"acknowledged prompt {i} lost: hit {hit}, {failure}"
        fresh = scenario.tokens(33)
        record = await scenario.produce(fresh)
        assert record.durable, "a store after the fault cleared is not durable"
        assert await consume(engine, scenario, fresh + [1]) == (HIT, None)
        disk = engine.disk_tier
        assert disk.statistics().as_dict()["degraded"] == 0.0
        assert await disk.check() == []  # type: ignore[attr-defined]

    orphans: List[int] = []
    await engine_life(kind, path, plan, body)
    return orphans[0]


@dataclass
class Sweep:
    runs: int = 0
    clean_calls: int = 0
    first_fault_by_op: Dict[str, int] = field(default_factory=dict)
    faults_by_op: Dict[str, int] = field(default_factory=dict)
    undurable_prompts: int = 0
    failed_loads: int = 0
    orphan_records: int = 0


async def sweep(kind: str, root: Path, mode: str) -> Sweep:
    """N = 1, 2, ... until the workload no longer reaches call N."""
    out = Sweep()
    n = 0
    while True:
        n += 1
        plan = IOFaultPlan(**{("fail_at" if mode == "once" else "fail_from"): n})
        path = root / f"{mode}-{n}"
        seed = n
        try:
            first, second, shared = await workload(kind, path, plan, seed, mode)
            out.runs = n
            if plan.faults == 0:
                out.clean_calls = plan.calls
                return out
            op = plan.fault_log[0][1]
            out.first_fault_by_op[op] = out.first_fault_by_op.get(op, 0) + 1
            for _, op in plan.fault_log:
                out.faults_by_op[op] = out.faults_by_op.get(op, 0) + 1
            undurable = sum(1 for d in first.durable.values() if not d)
            out.undurable_prompts += undurable
            out.failed_loads += sum(1 for _, _, f in first.loads + second.loads if f is not None)
            if mode == "once":
                # One failure spoils at most the batch or read it hit, never later calls.
                assert undurable <= 1, (first.durable, plan.fault_log)
            out.orphan_records += await after_healing(kind, path, plan, first, shared, seed, mode)
        except Exception as exc:
            raise AssertionError(
                f"{kind} tier, fault {mode} at call {n} ({plan.fault_log[:3]}, ops seen {dict(plan.calls_by_op)}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        assert n < 1000, "the workload never completes"


@pytest.fixture
def sweep_root(tmp_path: Path):
    """A scratch directory on tmpfs when there is one: the sweep runs the workload hundreds of
    times and tests the tiers' handling of injected errors, not the disk, so fsync need not wait."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        root = Path(tempfile.mkdtemp(prefix="kvtier-io-sweep-", dir="/dev/shm"))
        yield root
        shutil.rmtree(root, ignore_errors=True)
    else:
        yield tmp_path


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["once", "forever"])
@pytest.mark.parametrize("kind", ["lmdb", "files"])
async def test_io_error_at_every_call(sweep_root: Path, kind: str, mode: str) -> None:
    started = time.monotonic()
    result = await sweep(kind, sweep_root, mode)
    ops = LMDB_IO_OPS if kind == "lmdb" else FILE_IO_OPS
    print(
        f"fault-suite: {kind} tier, fault {mode}: N = 1..{result.runs - 1} tried (a clean run makes "
        f"{result.clean_calls} counted operations); first fault by operation {result.first_fault_by_op}; "
        f"faults injected by operation {result.faults_by_op}; {result.undurable_prompts} prompts not durable, "
        f"{result.failed_loads} loads failed cleanly, {result.orphan_records} records of failed batches "
        f"visible after restart; every acknowledged prompt loaded bitwise after healing; {time.monotonic() - started:.1f} s"
    )
    assert result.runs > 5
    # Every kind of operation the workload performs was failed first at least once.
    seen = set(result.first_fault_by_op)
    expected = {"put", "commit", "read"} if kind == "lmdb" else set(FILE_IO_OPS) - {"remove"}
    assert expected <= seen, f"never failed: {expected - seen}; ops known: {ops}"
    if kind == "files" and mode == "forever":
        assert result.faults_by_op.get("remove", 0) > 0  # rollbacks were failed too


@pytest.mark.asyncio
async def test_remove_io_faults_refuses_a_tier_it_cannot_see_through(tmp_path: Path) -> None:
    """Removing faults through a wrapper other than ``FaultyTier`` is a TypeError, as injecting is:
    it must not leave the plan installed under the wrapper while seeming to have removed it."""
    tier = await LmdbTier.open(tmp_path / "lmdb", map_size_bytes=1 << 20)
    try:
        plan = inject_io_faults(tier, fail_from=1, ops=("put",))
        with pytest.raises(TypeError, match="^cannot remove I/O faults under SeamTier$"):
            remove_io_faults(SeamTier(tier))
        assert tier._io_hook is plan
        remove_io_faults(FaultyTier(tier))  # looked through
        assert tier._io_hook is NO_IO_HOOK
    finally:
        await tier.close()
