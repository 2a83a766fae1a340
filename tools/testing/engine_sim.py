"""A seeded, model-based simulation of the engine: random interleavings, cancellations and faults.

Primitives: ``simulate(tmp_dir, seed=..., steps=..., tier="lmdb"|"files")`` -> ``SimReport``;
``SimViolation`` (an invariant broke: the message says which, with the seed to replay it). The
model it checks against (device blocks, the tier's history) is ``engine_sim_model``'s; the hooks it
sets into the engine and its tier, and the per-step host-slot checks, are ``engine_sim_watch``'s.
Runs on the caller's event loop; the engine under test is real (real LMDB or file tier, real host
pools, real copy threads over CPU tensors); faults enter through ``SeamTier`` (the tier seam) and
through the device view's two batch-copy methods.

What it does, per step, chosen by a ``random.Random(seed)``: start an actor (store, lookup+load,
prefetch, fence, flush, refresh_disk_index, a second writer putting records straight into the
tier), cancel a random actor at whatever ``await`` it is in, inject a fault (a ``TierIOError`` or a
foreign ``ValueError`` / ``MemoryError`` / ``ConnectionResetError``, before or after the tier did
the work; a delay; a stall of one tier operation; a failing device copy), heal, or let time pass.
Actors run concurrently, so these interleave.

The model kept by the simulation, and what it checks (after every step, and at the end):

- chunk bytes are a pure function of (key, block of the chunk, layer), so every writer of a key
  writes the same bytes; every block a successful load writes must hold exactly those bytes, never
  another request's;
- device blocks the simulation freed hold a sentinel pattern until they are reused: a late copy
  writing into a freed block is caught (blocks are freed only after ``wait_released`` or ``fence``,
  as the engine's contract tells a serving process);
- the tier's history, as the engine hears it: every put that landed (its sequence, recorded as
  the tier answers, before any seam fault), every removal report (key, sequence, and when it came:
  recorded in the same loop turn as the engine's own subscriber sees it), every host eviction;
- a chunk is promised durable when the store found it on disk, or when the engine settles its
  spill; at that moment the history must not show it removed (a removal at or after its last
  put, already reported: checked inside the engine's call, so an add the index refused, or one it
  wrongly made, is caught whether or not anyone checks the handle);
- ``wait_durable() == True``: every chunk of the handle is on the tier, unless a removal explains
  its absence: reported *after* the chunk was promised (a removal the engine knew of when it
  promised explains nothing) and with a sequence greater than the key's last put at that moment
  (a removal of an older record explains nothing either);
- a host slot a tier read was handed stays allocated, pinned and owned by that read's chunk until
  the tier answers (a timed-out read gives nothing back early); every host copy the engine calls
  valid (queued, spilling, ready) holds its chunk's bytes; both after every step;
- a hit ``lookup`` admits is loaded, unless a fault was injected or the answer is a capacity one
  (``host_full``, ``timeout``); a ``missing`` chunk is explained only the same exact way: a host
  eviction of one of the hit's chunks after the lookup, or a removal of one reported after it with
  a sequence greater than the chunk's last put at the lookup;
- ``engine.check()`` after every step; once faults stop, every waiting call (``wait_released``,
  ``fence``, ``flush``, loads) resolves within ``settle_s``; at the end ``check()`` and
  ``check_disk()`` pass, a fresh lookup+load of stored prompts returns the right bytes, and
  ``close()`` leaves no pinned slot, no task and no engine thread;
- a third of the seeds end instead with ``close()`` amid work in flight (a first close cancelled
  at a random await, then a second): every actor ends within ``settle_s`` and no late copy writes
  into a freed block.
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Dict, List, Optional, Set, Tuple

from kvtier.engine import EngineConfig, LoadResult, OffloadEngine
from kvtier.errors import KvtierError, TierIOError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.base import ChunkMeta
from kvtier.tools.testing.pressure import ScriptedSource

from .engine_sim_model import History, Moment, Promise, SimDevice, SimViolation
from .engine_sim_watch import (CopyFaults, check_host_copies, check_promises, check_reads_in_flight, record_evictions,
                               record_tier, track_reads)
from .scenario import make_cpu_device
from .tier_seam import SeamTier

if TYPE_CHECKING:
    from kvtier.engine.durable import DurableWatch

__all__ = ["simulate", "SimReport", "SimViolation", "SIM_LAYOUT"]

SIM_LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
FOREIGN_ERRORS: Tuple[Callable[[], BaseException], ...] = (
    lambda: TierIOError("sim: injected I/O error"),
    lambda: ValueError("sim: codec does not know this dtype"),
    lambda: MemoryError(),
    lambda: ConnectionResetError("sim: peer reset"),
)
SEAM_FAULT_OPS = ("put_many", "get_many_into", "list_keys")
# What one step does, with its weight: start an actor, cancel one, inject a fault, heal, or wait.
STEP_WEIGHTS: Dict[str, float] = {
    "store": 22, "load": 18, "prefetch": 6, "fence": 4, "flush": 3, "refresh": 3, "second_writer": 3,
    "cancel": 10, "inject": 6, "heal": 5, "wait": 20,
}  # fmt: skip
ACTORS = ("store", "load", "prefetch", "fence", "flush", "refresh", "second_writer")
# Load failures that are capacity answers (the serving process recomputes), never a broken promise.
CAPACITY_REASONS = {"host_full", "timeout"}


@dataclass
class SimReport:
    seed: int
    tier: str
    steps: int = 0
    actors: Dict[str, int] = field(default_factory=dict)
    cancelled: int = 0
    faults: int = 0
    max_concurrency: int = 0
    overlapping_steps: int = 0  # steps that began with two or more actors in flight
    loads_ok: int = 0
    loads_failed: Dict[str, int] = field(default_factory=dict)
    durable_checked: int = 0
    bytes_checked: int = 0
    host_copies_checked: int = 0
    promises_checked: int = 0  # chunks the engine settled durable, checked against the history then
    closed_under_load: bool = False  # the run ended with close() amid work in flight

    def summary(self) -> str:
        return (
            f"seed {self.seed} ({self.tier}): {self.steps} steps, {sum(self.actors.values())} actors "
            f"{dict(sorted(self.actors.items()))}, {self.cancelled} cancelled, {self.faults} faults, "
            f"{self.overlapping_steps} steps with >= 2 actors in flight (max {self.max_concurrency}), "
            f"{self.loads_ok} loads ok, failed {self.loads_failed}, {self.durable_checked} durable "
            f"handles checked on the tier, {self.promises_checked} chunk promises checked when made, "
            f"{self.bytes_checked} blocks compared, {self.host_copies_checked} host copies compared"
            + (", closed under load" if self.closed_under_load else "")
        )


class _Sim:
    def __init__(self, engine: OffloadEngine, seam: SeamTier, inner, seed: int, tier: str, settle_s: float) -> None:
        self.engine = engine
        self.seam = seam
        self.inner = inner
        self.seed = seed
        self.rng = random.Random(seed)
        self.report = SimReport(seed, tier)
        self.device = SimDevice(engine, self.rng)
        self.settle_s = settle_s
        self.actors: Set[asyncio.Task] = set()
        self.reapers: Set[asyncio.Task] = set()
        self.fault_epoch = 0  # bumps at every injected fault
        self.prompts: List[List[int]] = []
        self.history = History()
        self.broken: List[str] = []  # promises found broken inside the engine's calls
        self._started = 0
        self._start_order: Dict[asyncio.Task, int] = {}  # running actors: a seed cancels the same victim
        self.copy_faults = CopyFaults(engine.device)
        # What the engine does, recorded (subscribed after the engine) and checked as it happens.
        record_tier(inner, self.history)
        record_evictions(engine.host, self.history)
        check_promises(self._spill_watch(), self.history, self.report, self.broken, seed)
        self.reads_in_flight = track_reads(seam, engine.host)

    def _spill_watch(self) -> DurableWatch:
        spill = self.engine._spill
        assert spill is not None, "the simulated engine has a disk tier, so a spill pipeline"
        return spill.watch

    # -- prompts ---------------------------------------------------------------------------------

    def prompt(self) -> List[int]:
        """A prompt sharing a prefix with an earlier one most of the time (so stores overlap)."""
        rng = self.rng
        if self.prompts and rng.random() < 0.7:
            base = rng.choice(self.prompts)
            cut = rng.randrange(0, len(base) + 1)
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
            prompt = (base[:cut] + tail)[:96]
        else:
            prompt = [rng.randrange(50) for _ in range(rng.randrange(8, 96))]
        if len(self.prompts) < 64:
            self.prompts.append(prompt)
        else:
            self.prompts[rng.randrange(64)] = prompt
        return prompt

    # -- actors ----------------------------------------------------------------------------------

    def start(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self.report.actors[name] = self.report.actors.get(name, 0) + 1
        task = asyncio.ensure_future(coro)
        task.sim_name = name  # type: ignore[attr-defined]  # read back (getattr) in failure messages
        self._started += 1
        self._start_order[task] = self._started
        self.actors.add(task)
        task.add_done_callback(self._actor_done)

    def _actor_done(self, task: asyncio.Task) -> None:
        self.actors.discard(task)
        del self._start_order[task]

    def reap(self, table, blocks_done: Callable[[], Any]) -> None:
        """Free ``table`` once ``blocks_done()`` (a fence or wait_released) resolves, uncancelled:
        what a serving process does with the blocks of a request it aborted."""

        async def reaper():
            await asyncio.wait_for(blocks_done(), self.settle_s * 4)
            self.device.release(table)

        task = asyncio.ensure_future(reaper())
        self.reapers.add(task)
        task.add_done_callback(self.reapers.discard)

    def fence_all(self, table):
        async def fenced():
            for g, blocks in enumerate(table):
                await self.engine.fence(blocks, g)

        return fenced

    async def act_store(self) -> None:
        # A third of the stores repeat a prompt exactly: they find their chunks stored or in flight.
        prompt = self.rng.choice(self.prompts) if self.prompts and self.rng.random() < 0.33 else self.prompt()
        table = self.device.allocate(len(prompt))
        if table is None:
            return
        keys = self.engine.request_keys(prompt)
        self.device.fill(keys, table, len(prompt))
        num_tokens = self.rng.choice([len(prompt), self.rng.randrange(0, len(prompt) + 1)])
        handle = self.engine.store(keys, table, num_tokens)
        wanted = [keys.keys[g][c] for g, c in list(handle.scheduled) + list(handle.skipped)]
        waiting = set() if handle.durable_known else set(self._spill_watch()._waiting.get(handle, ()))
        promise = self.history.promise(waiting, wanted)
        try:
            await handle.wait_released()
        except asyncio.CancelledError:
            self.reap(table, handle.wait_released)
            raise
        self.device.release(table)
        if handle.drop_reason is None and self.rng.random() < 0.8:
            if await handle.wait_durable():
                await self.check_durable(wanted, promise)

    async def check_durable(self, wanted: List[bytes], promise: Promise) -> None:
        """Every chunk of a durable handle is on the tier, or a removal reported after the chunk was
        promised (with a sequence past the chunk's last put then) explains its absence."""
        present = await self.inner.contains_many(wanted)
        missing = [k for k, there in zip(wanted, present) if not there]
        if missing:
            await self._reports_arrive()
            history = self.history
            unexplained = [k for k in missing if not history.removed_since(k, history.promised_at(k, promise))]
            if unexplained:
                first = unexplained[0]
                raise SimViolation(
                    f"seed {self.seed}: wait_durable() was True but {len(unexplained)} chunks are not on the tier "
                    f"and no removal reported after the promise explains it (first {first.hex()[:12]}, "
                    f"{history.describe(first, history.promised_at(first, promise))})"
                )
        self.report.durable_checked += 1

    async def _reports_arrive(self) -> None:
        """Let removal reports still on their way reach the loop."""
        await self.inner.flush()
        await asyncio.sleep(0.01)

    async def _missing_explained(self, keys, moment: Moment) -> bool:
        """A load failed ``missing``: a chunk of the request left the host, or the tier, after the
        lookup (see the module docstring)."""
        await self._reports_arrive()
        wanted = [k for group in keys.keys for k in group]
        return any(self.history.host_evicted_since(k, moment) or self.history.removed_since(k, moment)
                   for k in wanted)

    def _look_up(self, prompt: List[int]) -> Tuple[Any, Moment, Any]:
        """The prompt's keys, the history's moment just before the lookup, and the hit it admits."""
        keys = self.engine.request_keys(prompt)
        moment = self.history.now([k for group in keys.keys for k in group])
        return keys, moment, self.engine.lookup(keys)

    async def act_load(self) -> None:
        prompt = self.rng.choice(self.prompts) if self.prompts else self.prompt()
        faults = self._faults_fired()
        keys, moment, hit = self._look_up(prompt)
        if not hit:
            return
        table = self.device.allocate(len(prompt))
        if table is None:
            return
        try:
            result = await self.engine.load(keys, hit, table)
        except asyncio.CancelledError:
            self.reap(table, self.fence_all(table))
            raise
        if result.ok:
            self.report.loads_ok += 1
            self.report.bytes_checked += self.device.expect(keys, table, result.loaded, self.seed)
        else:
            self._count_failed(result)
            if result.reason == "missing":
                explained = await self._missing_explained(keys, moment)
            else:
                explained = result.reason in CAPACITY_REASONS or self._faults_fired() != faults
            if not explained:
                raise SimViolation(
                    f"seed {self.seed}: lookup admitted a hit of {hit} tokens that load failed with "
                    f"{result.reason!r}, and no fault, host eviction or later removal of its chunks explains it"
                )
        self.device.release(table)

    def _faults_fired(self) -> Tuple[int, int, int]:
        """Changes whenever a fault is injected or a scripted one fires (a fault scripted before a
        lookup may fire at a call made after it)."""
        return self.fault_epoch, self.seam.faults, self.copy_faults.fired

    def _count_failed(self, result: LoadResult) -> None:
        """Count a failed load under its reason, which a failed load always gives."""
        if result.reason is None:
            raise SimViolation(f"seed {self.seed}: a load failed without a reason")
        self.report.loads_failed[result.reason] = self.report.loads_failed.get(result.reason, 0) + 1

    async def act_prefetch(self) -> None:
        if not self.prompts:
            return
        policy = self.rng.choice(["best_effort", "wait_complete", "timeout"])
        await self.engine.prefetch(self.rng.choice(self.prompts), policy=policy,
                                   timeout_s=0.05 if policy == "timeout" else None)

    async def act_fence(self) -> None:
        g = self.rng.randrange(len(self.device.layout.groups))
        blocks = self.rng.sample(range(self.engine.device.num_blocks(g)), 8)
        await self.engine.fence(blocks, g)

    async def act_flush(self) -> None:
        await self.engine.flush()

    async def act_refresh(self) -> None:
        await self.engine.refresh_disk_index()

    async def act_second_writer(self) -> None:
        """Another process (here: a direct write into the same tier) stores a prompt's chunks."""
        prompt = self.prompt()
        keys = self.engine.request_keys(prompt)
        items = []
        for g, group in enumerate(self.device.layout.groups):
            per_chunk = group.blocks_per_chunk
            for chunk, key in enumerate(keys.keys[g][: len(prompt) // (group.block_size * per_chunk)]):
                raw = self.device.chunk_bytes(key, g).numpy().tobytes()
                dtype, shape = self.engine.host.metas[g]
                items.append((key, ChunkMeta(self.engine.fingerprint, g, chunk, dtype, shape), memoryview(bytearray(raw))))
        if items:
            await self.inner.put_many(items[: 8])

    # -- faults ----------------------------------------------------------------------------------

    def inject(self) -> None:
        rng = self.rng
        self.fault_epoch += 1
        self.report.faults += 1
        kind = rng.random()
        op = rng.choice(SEAM_FAULT_OPS)
        if kind < 0.45:
            self.seam.fail_next(op, rng.choice(FOREIGN_ERRORS)(), after=rng.random() < 0.3 and op != "get_many_into")
        elif kind < 0.7:
            self.seam.delay_next(op, rng.choice([0.001, 0.01, 0.05]))
        elif kind < 0.85:
            self.seam.stall(op)
        else:
            self.copy_faults.pending.append(rng.choice(FOREIGN_ERRORS)())

    def heal(self) -> None:
        self.seam.heal()
        self.copy_faults.pending.clear()

    # -- the loop --------------------------------------------------------------------------------

    async def step(self) -> None:
        rng = self.rng
        report = self.report
        report.steps += 1
        if len(self.actors) >= 2:
            report.overlapping_steps += 1
        report.max_concurrency = max(report.max_concurrency, len(self.actors))
        action = rng.choices(list(STEP_WEIGHTS), weights=list(STEP_WEIGHTS.values()))[0]
        if action in ACTORS:
            self.start(action, getattr(self, f"act_{action}")())
        elif action == "cancel":
            if self.actors:
                victim = rng.choice(sorted(self.actors, key=self._start_order.__getitem__))
                if not victim.done():
                    victim.cancel()
                    report.cancelled += 1
        elif action == "inject":
            self.inject()
        elif action == "heal":
            self.heal()
        else:  # let time pass: a few loop turns, sometimes a real sleep
            for _ in range(rng.randrange(1, 6)):
                await asyncio.sleep(0)
            if rng.random() < 0.2:
                await asyncio.sleep(rng.choice([0.001, 0.005, 0.02]))
        await asyncio.sleep(0)
        self.harvest()
        self.engine.check()
        check_reads_in_flight(self.engine.host, self.reads_in_flight, self.seed)
        self.report.host_copies_checked += check_host_copies(self.engine.host, self.device, self.seed)
        if report.steps % 25 == 0:
            self.device.check_free(self.seed)

    def harvest(self) -> None:
        if self.broken:
            raise SimViolation(self.broken[0])
        for task in [t for t in list(self.actors) + list(self.reapers) if t.done()]:
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is None:
                continue
            if isinstance(exc, SimViolation):
                raise exc
            if isinstance(exc, KvtierError) and not isinstance(exc, AssertionError):
                continue  # a typed engine error (e.g. ClosedError) is an answer
            raise SimViolation(f"seed {self.seed}: actor {getattr(task, 'sim_name', '?')} raised {exc!r}") from exc

    async def finish_by_closing(self) -> None:
        """Faults stop and the engine closes with work in flight: a first ``close`` cancelled at a
        random await, a second one to finish. Every actor must then end (with a result or a
        ``ClosedError``) within ``settle_s``, and no late copy may write into a freed block."""
        self.heal()
        closing = asyncio.ensure_future(self.engine.close())
        for _ in range(self.rng.randrange(0, 6)):
            await asyncio.sleep(0)
        if not closing.done():
            closing.cancel()
            self.report.cancelled += 1
        await asyncio.gather(closing, return_exceptions=True)
        try:
            await asyncio.wait_for(self.engine.close(), self.settle_s)
        except asyncio.TimeoutError:
            raise SimViolation(f"seed {self.seed}: close() did not finish within {self.settle_s} s") from None
        pending = [t for t in self.actors | self.reapers if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=self.settle_s)
            if still:
                names = sorted(getattr(t, "sim_name", "reaper") for t in still)
                raise SimViolation(f"seed {self.seed}: {len(still)} calls still waiting after close: {names}")
        self.harvest()
        self.device.check_free(self.seed)
        if self.engine._tasks and any(not t.done() for t in self.engine._tasks):
            raise SimViolation(f"seed {self.seed}: engine tasks still running after close")
        if not all(pool.closed for pool in self.engine.host.pools):
            raise SimViolation(f"seed {self.seed}: close() left a host pool open")

    async def finish(self) -> None:
        """Faults stop; everything in flight must resolve within ``settle_s``."""
        self.heal()
        pending = [t for t in self.actors | self.reapers if not t.done()]
        if pending:
            done, still = await asyncio.wait(pending, timeout=self.settle_s)
            if still:
                names = sorted(getattr(t, "sim_name", "reaper") for t in still)
                raise SimViolation(f"seed {self.seed}: {len(still)} calls still waiting {self.settle_s} s after the "
                                   f"faults stopped: {names}")
        self.harvest()
        try:
            await asyncio.wait_for(self.engine.flush(), self.settle_s)
        except asyncio.TimeoutError:
            raise SimViolation(f"seed {self.seed}: flush() did not return within {self.settle_s} s of healing") from None
        self.engine.check()
        await self.engine.check_disk()
        self.device.check_free(self.seed)
        # Every prompt the engine still answers for loads the right bytes.
        for prompt in self.prompts[:16]:
            keys, moment, hit = self._look_up(prompt)
            if not hit:
                continue
            table = self.device.allocate(len(prompt))
            if table is None:
                break
            result = await asyncio.wait_for(self.engine.load(keys, hit, table), self.settle_s)
            if result.ok:
                self.report.bytes_checked += self.device.expect(keys, table, result.loaded, self.seed)
            elif result.reason not in CAPACITY_REASONS and not (
                result.reason == "missing" and await self._missing_explained(keys, moment)
            ):
                self._count_failed(result)
                raise SimViolation(f"seed {self.seed}: after healing, an admitted hit failed with {result.reason!r}")
            self.device.release(table)
        await self.engine.flush()
        self.engine.check()
        for gi, pool in enumerate(self.engine.host.pools):
            if pool.statistics()["pinned_slots"]:
                raise SimViolation(f"seed {self.seed}: group {gi} has pinned slots once idle")


async def simulate(
    directory: Path,
    *,
    seed: int,
    steps: int = 300,
    tier: str = "lmdb",
    disk_capacity_records: Optional[int] = None,
    settle_s: float = 10.0,
) -> SimReport:
    """Run one simulation (see the module docstring) in ``directory``; raises ``SimViolation``."""
    from kvtier.tiers.files import FileTier
    from kvtier.tiers.lmdb import LmdbTier

    directory = Path(directory)
    layout = SIM_LAYOUT
    device = make_cpu_device(layout, num_blocks=160)
    record_bytes = max(device.chunk_nbytes(g) for g in range(len(layout.groups))) + 256
    if disk_capacity_records is None:
        # Per seed: a disk so small that each batch evicts the one before (the add/removal races
        # of the disk index), a tight one, or a roomy one.
        disk_capacity_records = random.Random(seed ^ 0x5EED).choice([5, 12, 48])
    capacity = disk_capacity_records * record_bytes if disk_capacity_records else None
    inner: LmdbTier | FileTier
    if tier == "lmdb":
        inner = await LmdbTier.open(directory / "lmdb", map_size_bytes=64 << 20, capacity_bytes=capacity)
    elif tier == "files":
        inner = await FileTier.open(directory / "files", capacity_bytes=capacity)
    else:
        raise ValueError(f"tier must be 'lmdb' or 'files', got {tier!r}")
    seam = SeamTier(inner)
    # Per seed, too: a host pool from tight to roomy, spill batches from one chunk to many, a
    # store queue that drops or never does.
    shape = random.Random(seed ^ 0xC0F1)
    config = EngineConfig(
        host_capacity_bytes=shape.choice([8, 24, 64]) * device.chunk_nbytes(0),
        # Per seed: a tier timeout that only stalls reach, or one that a delayed read passes, so
        # abandoned reads (whose slots must stay held until the tier lets go) happen often.
        tier_timeout_s=random.Random(seed ^ 0x71E0).choice([0.02, 0.3]),
        pressure_poll_interval_s=3600.0,
        spill_batch_max_chunks=shape.choice([1, 4, 16]),
        store_queue_max_chunks=shape.choice([16, 64, 4096]),
        events_max=256,
    )
    engine = OffloadEngine(layout, device, config, fingerprint=b"sim", disk_tier=seam,
                           pressure_sources={"host_memory": ScriptedSource([0.0])})
    threads_before = {t.ident for t in threading.enumerate()}
    await engine.start()
    sim = _Sim(engine, seam, inner, seed, tier, settle_s)
    try:
        for _ in range(steps):
            await sim.step()
        if random.Random(seed ^ 0xC105E).random() < 1 / 3:
            sim.report.closed_under_load = True
            await sim.finish_by_closing()
        else:
            await sim.finish()
    finally:
        sim.heal()
        for task in list(sim.actors | sim.reapers):
            task.cancel()
        await asyncio.wait_for(engine.close(), settle_s)
        await inner.close()
    if engine._tasks:
        raise SimViolation(f"seed {seed}: {len(engine._tasks)} engine tasks left after close")
    # The engine's own threads (its two copy threads); a tier's threads are the tier's business.
    leaked = [t.name for t in threading.enumerate()
              if t.ident not in threads_before and t.name.startswith(("kvtier-d2h", "kvtier-h2d"))]
    if leaked:
        raise SimViolation(f"seed {seed}: engine threads alive after close: {leaked}")
    return sim.report
