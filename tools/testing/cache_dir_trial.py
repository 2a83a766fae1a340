"""Many processes on one cache directory, kill -9 and injected I/O errors, checked against journals.

``run_trial(root, seed, rounds)`` drives one seeded trial and returns a ``TrialReport``:

- a long-lived writer (``cache_dir_child writer``: an ``LmdbTier`` acknowledging durable puts,
  deleting old batches, reading its chunks back) runs throughout; it is killed -9 at random points
  and restarted (a new life, new keys), and most lives fail one commit (a put's or a delete's) with
  an injected EIO or ENOSPC (``faults.IOFaultPlan``);
- each round starts two or three more processes side by side, chosen by the seed: a second writer
  (a warmup, killed -9 half the time), ``kvtier verify`` (writable, quarantining) and ``kvtier verify
  --no-quarantine``, ``kvtier gc`` with compaction (a bound above what is stored: it evicts nothing,
  and is killed -9 at times), a loop of writable opens (a server restarting), a journaled gc
  evicting down to a few MiB (``cache_dir_child gc``),
  ``kvtier inspect``, a read-only reader (``cache_dir_child read-check``), a restart of the writer;
  once, an ``OffloadEngine`` storing requests (``fault_child engine-spill``) killed -9 and then an
  engine restarted over the directory that must load every request it acknowledged bitwise
  (``fault_child.kill_during_spill``);
- a sampler thread reads ``/proc/<writer pid>/fd`` every 0.2 s: open descriptors, and the bytes of
  deleted files in the cache directory the writer still holds open, added to the directory's own.

Every child journals what it acknowledged (``cache_dir_child``); at the end (every process
stopped) the directory is opened read-only and checked against the journals: every acknowledged
record reads back bitwise, unless its own writer deleted it or a tier reported it evicted or deleted
with a sequence after its put (a removal excuses only what it explains); every record present is
one some writer tried and holds its bytes; no key reported removed is still present; no reader,
in any process, read bytes no put wrote or missed an acknowledged chunk nothing removed; no lookup
found a key after its delete returned; descriptors and disk bytes stay within the bounds below.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .cache_dir_child import JournalEntries, read_journal
from .children import chunk_content, parse_key, read_line
from .fault_child import kill_during_spill

__all__ = ["TrialReport", "run_trial", "HELD_DELETED_SLACK_BYTES", "DISK_BOUND_BYTES", "FD_SLACK"]

# What the workload keeps stored at most: the writer's window (9 batches of at most 6 x 200000
# bytes), a warmup's as much, warmups' leftovers and failed batches that landed, which a journaled
# gc to 8 MiB trims after any round that ends with the directory over CRON_GC_AT_BYTES (a cron
# `kvtier gc`). 24 MiB covers it with room.
STORED_BOUND_BYTES = 24 << 20
CRON_GC_AT_BYTES = 16 << 20
# Disk bytes over what is stored: segment files are compacted when less than half live (so up to
# twice their live bytes), one 1 MiB active segment per writer (with the blocks its puts allocate
# ahead: up to one batch more, given back when it rotates), LMDB's page rounding and free pages
# (a reader's snapshot pins pages freed after it). Stated bound on files in the directory plus
# deleted files the long-lived writer holds open:
DISK_BOUND_BYTES = 2 * STORED_BOUND_BYTES + (16 << 20)
# Deleted segment files the writer may still hold open at a sample: the ones a read or a
# compaction step in flight still uses (up to 4.3 MiB seen with the fixes on the shared 2-core
# machine: eight 1 MiB segments give room), never what went through (80-270 MiB before them).
HELD_DELETED_SLACK_BYTES = 8 << 20
# Descriptors over the writer's count at its first sample: a cached fd per live segment it reads
# (live bytes / 1 MiB segments) and threads' transient ones.
FD_SLACK = 64
CHILD_TIMEOUT_S = 90.0
SAMPLE_INTERVAL_S = 0.2


@dataclass
class TrialReport:
    seed: int
    rounds: int
    processes: "Counter[str]" = field(default_factory=Counter)  # started, by kind
    kills: "Counter[str]" = field(default_factory=Counter)  # SIGKILLed, by kind
    injected_faults: int = 0  # puts/commits the writers' IOFaultPlans failed (from their journals)
    tried: int = 0  # chunk keys put (acknowledged or not)
    acked: int = 0  # acknowledged chunk records
    deleted: int = 0  # acknowledged records their writer deleted
    evicted: int = 0  # acknowledged records a gc reported evicted
    present: int = 0  # records in the directory at the end, all checked bitwise
    reads: int = 0  # reads by the writers and the read-only readers, every hit checked
    reopens: int = 0  # writable opens by the reopen loops
    engine_requests: int = 0  # requests an engine acknowledged durable, loaded after its restart
    lost: List[str] = field(default_factory=list)  # acknowledged records gone with nothing to excuse it, one line each
    problems: List[str] = field(default_factory=list)
    peak_disk_bytes: int = 0
    peak_held_deleted_bytes: int = 0
    peak_fds: int = 0
    base_fds: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        procs = ", ".join(f"{n} {k}" for k, n in sorted(self.processes.items()))
        kills = ", ".join(f"{n} {k}" for k, n in sorted(self.kills.items()))
        return (
            f"seed {self.seed}: {sum(self.processes.values())} processes ({procs}); {sum(self.kills.values())} "
            f"kill -9 ({kills}); {self.reopens} writable reopens in loops; {self.injected_faults} injected I/O "
            f"errors; {self.acked} acknowledged records "
            f"of {self.tried} put, {self.deleted} deleted by their writer, {self.evicted} evicted by a gc; "
            f"{self.present} records checked at the end; {self.reads} reads checked; {self.engine_requests} "
            f"engine requests loaded after the restart; lost: {len(self.lost)}; other problems: "
            f"{len(self.problems)}; peak disk {self.peak_disk_bytes / 2**20:.1f} MiB (bound "
            f"{DISK_BOUND_BYTES >> 20}), deleted files held {self.peak_held_deleted_bytes / 2**20:.1f} MiB (bound "
            f"{HELD_DELETED_SLACK_BYTES >> 20}), fds {self.base_fds}..{self.peak_fds} (bound +{FD_SLACK}); "
            f"{self.seconds:.0f} s"
        )


def _module(name: str) -> List[str]:
    return [sys.executable, "-m", f"kvtier.tools.{name}"]


class _Trial:
    """One trial's processes, journals and samples (see the module docstring)."""

    def __init__(self, root: Path, seed: int, report: TrialReport) -> None:
        self.root = root
        self.cache = root / "cache"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.report = report
        self.lock = threading.Lock()
        self.writer_journals: List[Path] = []
        self.gc_journals: List[Path] = []
        self.reader_outputs: List[str] = []
        self.procs: List[subprocess.Popen] = []
        self.names = Counter()  # type: Counter[str]
        self.life: Optional[subprocess.Popen] = None
        self.stop_sampling = threading.Event()

    def key_seed(self, offset: int, n: int) -> int:
        """The seed a child's keys spell (a uint32): distinct for every writer, life and warmup."""
        return (self.seed % 200_000) * 20_000 + offset + n

    # ------------------------------------------------------------------------------- processes

    def start(self, kind: str, argv: Sequence[str], *, pipe: bool = False) -> Tuple[subprocess.Popen, Path]:
        with self.lock:
            self.names[kind] += 1
            n = self.names[kind]
            self.report.processes[kind] += 1
        err = self.logs / f"{kind}-{n}.stderr"
        with open(err, "wb") as handle:
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE if pipe else subprocess.DEVNULL,
                                    stderr=handle, stdin=subprocess.DEVNULL)
        with self.lock:
            self.procs.append(proc)
        return proc, err

    def journal(self, kind: str) -> Path:
        with self.lock:
            return self.logs / f"{kind}-{self.names[kind] + 1}.journal"

    def finish(self, kind: str, proc: subprocess.Popen, err: Path, kill_after_s: Optional[float],
               ok_codes: Sequence[int] = (0,)) -> Optional[str]:
        """Wait for ``proc`` (SIGKILL it after ``kill_after_s`` if given and still running); its
        stdout, or None when it was killed. A hang or an unexpected exit is a problem."""
        killed = False
        if kill_after_s is not None:
            try:
                proc.wait(timeout=kill_after_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                killed = True
        try:
            out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            self.problem(f"{kind} hung for {CHILD_TIMEOUT_S:.0f} s: {err.read_text(errors='replace')[-1500:]}")
            return None
        if killed and proc.returncode == -signal.SIGKILL:
            with self.lock:
                self.report.kills[kind] += 1
            return None
        text = (out or b"").decode(errors="replace")
        if proc.returncode not in ok_codes:
            self.problem(f"{kind} exited {proc.returncode}: {text[-1500:]} {err.read_text(errors='replace')[-1500:]}")
        return text

    def problem(self, text: str) -> None:
        with self.lock:
            self.report.problems.append(text)

    # ----------------------------------------------------------------- the long-lived writer

    def start_writer(self, rng: random.Random, life: int) -> None:
        journal = self.journal("writer")
        argv = _module("testing.cache_dir_child") + [
            "writer", "--dir", str(self.cache), "--journal", str(journal), "--seed", str(self.key_seed(0, life))]
        if rng.random() < 0.8:
            argv += ["--fail-at", str(rng.randint(10, 120))] + (["--enospc"] if rng.random() < 0.3 else [])
        proc, err = self.start("writer", argv, pipe=True)
        self.writer_journals.append(journal)
        try:
            line = read_line(proc, CHILD_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            self.problem(f"writer life {life} did not start ({exc}): {err.read_text(errors='replace')[-1500:]}")
            line = ""
        if line != "ready" and line:
            self.problem(f"writer life {life} said {line!r}")
        with self.lock:
            self.life = proc

    def kill_writer(self) -> None:
        with self.lock:
            proc, self.life = self.life, None
        if proc is None:
            return
        if proc.poll() is not None:
            self.problem(f"the writer ended by itself with {proc.returncode}")
            return
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=CHILD_TIMEOUT_S)
        with self.lock:
            self.report.kills["writer"] += 1

    # ---------------------------------------------------------------------------- sampling

    def sample_forever(self) -> None:
        while not self.stop_sampling.wait(SAMPLE_INTERVAL_S):
            with self.lock:
                proc = self.life
            if proc is not None:
                self.sample(proc.pid)

    def directory_bytes(self) -> int:
        total = 0
        for path in self.cache.iterdir():
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass  # deleted since the listing
        return total

    def sample(self, pid: int) -> None:
        disk = 0
        try:
            names = os.listdir(self.cache)
        except FileNotFoundError:
            return
        for name in names:
            try:
                disk += os.stat(self.cache / name).st_size
            except FileNotFoundError:
                pass  # deleted since the listing
        held: Dict[Tuple[int, int], int] = {}
        fds = 0
        prefix = str(self.cache) + "/"
        try:
            entries = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError):
            return  # the writer is being killed
        for fd in entries:
            fds += 1
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix) and target.endswith(" (deleted)"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")  # the open file itself, deleted or not
                    held[(st.st_dev, st.st_ino)] = st.st_size
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass  # closed meanwhile
        with self.lock:
            r = self.report
            if not r.base_fds:
                r.base_fds = fds
            r.peak_fds = max(r.peak_fds, fds)
            r.peak_held_deleted_bytes = max(r.peak_held_deleted_bytes, sum(held.values()))
            r.peak_disk_bytes = max(r.peak_disk_bytes, disk + sum(held.values()))

    # ------------------------------------------------------------------------------ actions

    def warmup(self, rng: random.Random, round_s: float) -> None:
        journal = self.journal("warmup")
        argv = _module("testing.cache_dir_child") + [
            "writer", "--dir", str(self.cache), "--journal", str(journal), "--seed",
            str(self.key_seed(10_000, self.names["warmup"])), "--duration-s", f"{round_s:.2f}"]
        if rng.random() < 0.5:
            argv += ["--fail-at", str(rng.randint(5, 60))]
        proc, err = self.start("warmup", argv, pipe=True)
        self.writer_journals.append(journal)
        kill = rng.uniform(0.5, round_s + 1.0) if rng.random() < 0.5 else None
        self.finish("warmup", proc, err, kill)

    def cli(self, kind: str, args: Sequence[str], rng: random.Random, kill_p: float) -> None:
        proc, err = self.start(kind, _module("cli") + list(args) + ["--cache-dir", str(self.cache), "--json"],
                               pipe=True)
        kill = rng.uniform(0.3, 2.5) if rng.random() < kill_p else None
        out = self.finish(kind, proc, err, kill)
        if out is not None and kind == "kvtier-gc":
            report = json.loads(out)
            if report["evicted_records"]:
                self.problem(f"kvtier gc above what is stored evicted {report['evicted_records']} records")

    def journaled_gc(self, rng: random.Random, mib: Optional[int] = None) -> None:
        journal = self.journal("gc-evict")
        mib = rng.choice((2, 4, 8)) if mib is None else mib
        proc, err = self.start("gc-evict", _module("testing.cache_dir_child") + [
            "gc", "--dir", str(self.cache), "--journal", str(journal), "--max-bytes", str(mib << 20)])
        self.gc_journals.append(journal)
        self.finish("gc-evict", proc, err, None)

    def read_check(self, rng: random.Random, round_s: float) -> None:
        proc, err = self.start("read-check", _module("testing.cache_dir_child") + [
            "read-check", "--dir", str(self.cache), "--seed", str(rng.randrange(1 << 30)),
            "--duration-s", f"{round_s:.2f}"], pipe=True)
        out = self.finish("read-check", proc, err, None)
        if out is not None:
            with self.lock:
                self.reader_outputs.append(out)

    def reopen(self, round_s: float) -> None:
        proc, err = self.start("reopen-loop", _module("testing.cache_dir_child") + [
            "reopen", "--dir", str(self.cache), "--duration-s", f"{round_s:.2f}"], pipe=True)
        out = self.finish("reopen-loop", proc, err, None)
        if out:
            with self.lock:
                self.report.reopens += int(json.loads(out.split("done ", 1)[1])["opens"])

    def engine(self, rng: random.Random) -> None:
        with self.lock:
            self.report.processes["engine"] += 1
        result = kill_during_spill(self.cache, self.key_seed(19_999, 0), rng.uniform(1.0, 2.5), mode="engine",
                                   ready_timeout_s=CHILD_TIMEOUT_S)
        with self.lock:
            self.report.kills["engine"] += 1
            self.report.processes["engine-restart (this process)"] += 1
            self.report.engine_requests += len(result.acked)
        for text in result.problems:
            self.problem(f"engine: {text}")

    def stop_all(self) -> None:
        self.kill_writer()
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_trial(root: Path, seed: int, rounds: int, *, engine_round: Optional[int] = None) -> TrialReport:
    """Run one trial of ``rounds`` rounds (about 3 s each) under ``root`` and check it (blocking).
    ``engine_round``: the round that runs the engine (``None``: the middle one; -1: none)."""
    started = time.monotonic()
    report = TrialReport(seed, rounds)
    trial = _Trial(root, seed, report)
    rng = random.Random(seed)
    sampler = threading.Thread(target=trial.sample_forever, name="kvtier-trial-sampler", daemon=True)
    engine_at = rounds // 2 if engine_round is None else engine_round
    life = 0
    try:
        trial.start_writer(rng, life)
        sampler.start()
        with ThreadPoolExecutor(max_workers=4) as pool:
            for r in range(rounds):
                round_s = rng.uniform(2.0, 3.5)
                menu: List[Tuple[str, Callable[[random.Random], None]]] = [
                    ("warmup", lambda g: trial.warmup(g, round_s)),
                    ("verify", lambda g: trial.cli("kvtier-verify", ["verify"], g, 0.3)),
                    ("verify-ro", lambda g: trial.cli("kvtier-verify-ro", ["verify", "--no-quarantine"], g, 0.0)),
                    ("gc", lambda g: trial.cli("kvtier-gc", ["gc", "--max-bytes", "1GiB"], g, 0.3)),
                    ("inspect", lambda g: trial.cli("kvtier-inspect", ["inspect"], g, 0.0)),
                    ("read-check", lambda g: trial.read_check(g, round_s)),
                    ("reopen", lambda g: trial.reopen(round_s)),
                ]
                if r != engine_at:
                    menu.append(("gc-evict", lambda g: trial.journaled_gc(g)))
                picks = rng.sample(menu, 3 if r % 2 else 2)
                if r == engine_at:
                    picks.append(("engine", lambda g: trial.engine(g)))
                futures = [pool.submit(action, random.Random(rng.randrange(1 << 30))) for _, action in picks]
                if rng.random() < 0.5:  # the writer dies mid-round and a new life starts
                    time.sleep(rng.uniform(0.2, round_s))
                    trial.kill_writer()
                    life += 1
                    trial.start_writer(rng, life)
                for future in futures:
                    future.result()
                if trial.directory_bytes() > CRON_GC_AT_BYTES:  # a cron gc keeps the directory bounded
                    trial.journaled_gc(rng, 8)
                with trial.lock:
                    alive = trial.life is not None and trial.life.poll() is None
                if not alive:
                    err = trial.logs / f"writer-{trial.names['writer']}.stderr"
                    trial.problem(f"the writer died by itself in round {r}: {err.read_text(errors='replace')[-1500:]}")
                    life += 1
                    trial.start_writer(rng, life)
    finally:
        trial.stop_sampling.set()
        trial.stop_all()
        if sampler.is_alive():
            sampler.join(timeout=10)
    check_against_journals(trial)
    report.seconds = time.monotonic() - started
    return report


def _excused(key: bytes, acked_at: int, own: Optional[JournalEntries], removals: Dict[bytes, List[tuple]]) -> Optional[str]:
    """Why an acknowledged record may be absent: its writer deleted it (``own``: that writer's
    journal; ``None`` for a read its writer made while the key was not being deleted), or a tier
    reported it evicted or deleted by a commit after its put; None when nothing explains it."""
    if own is not None and key in own.deleting:
        return "deleted"
    for sequence, reason in removals.get(key, ()):
        if reason in ("evicted", "deleted") and sequence > acked_at:
            return reason
    return None


def check_against_journals(trial: _Trial) -> None:
    """The end-of-trial check (every process stopped): see the module docstring."""
    from kvtier.tiers.lmdb import LmdbTier

    r = trial.report
    writers = [read_journal(p) for p in trial.writer_journals]
    gcs = [read_journal(p) for p in trial.gc_journals]
    removals: Dict[bytes, List[tuple]] = {}
    for j in writers + gcs:
        for key, entries in j.removed.items():
            removals.setdefault(key, []).extend(entries)
    lost: Dict[bytes, str] = {}
    tried = {k for j in writers for k in j.tried}
    r.tried = len(tried)
    r.acked = sum(len(j.acked) for j in writers)
    for j in writers:
        if j.done is not None:
            r.reads += int(j.done["reads"])
        for key in j.bad:
            r.problems.append(f"a writer read bytes no put wrote for {key.hex()}")
        r.problems.extend(j.untyped)
        for key in j.admitted:
            r.problems.append(f"a lookup found {key.hex()} after its delete returned")
        for key in dict.fromkeys(j.missed):  # a read while the key was not being deleted by its writer
            if key in j.acked and _excused(key, j.acked[key], None, removals) is None:
                lost[key] = "a read by its own writer missed it"
        for key, entries in j.removed.items():
            # No record is damaged on purpose: a quarantine before its delete is a loss.
            quarantined = [seq for seq, reason in entries if reason == "quarantined"]
            if key in j.acked and quarantined and min(quarantined) < j.gone.get(key, 1 << 62):
                lost.setdefault(key, f"acknowledged, good, quarantined at sequence {min(quarantined)}")
    for out in trial.reader_outputs:
        for line in out.splitlines():
            if line.startswith("BAD "):
                r.problems.append(f"a read-only reader read bytes no put wrote for {line[4:]}")
            elif line.startswith("done "):
                r.reads += int(json.loads(line[5:])["reads"])
    r.injected_faults = sum(len(j.failed) + len(j.failed_deletes) for j in writers)

    with LmdbTier(trial.cache, readonly=True, map_size_bytes=1 << 20, verify_structure=True) as tier:
        report = tier.verify(quarantine=False)
        for key, reason in report.corrupt:
            r.problems.append(f"verify at the end: corrupt record {key.hex()}: {reason}")
        keys = [info.key for info in tier.iter_records()]
        ours = [k for k in keys if parse_key(k) is not None]
        intact = set()
        for i in range(0, len(ours), 64):
            part = ours[i : i + 64]
            bufs = [bytearray(parse_key(k).nbytes) for k in part]  # type: ignore[union-attr]
            metas = asyncio.run(_read(tier, part, bufs))
            for key, meta, buf in zip(part, metas, bufs):
                if meta is not None and bytes(buf) == chunk_content(key):
                    intact.add(key)
                else:
                    r.problems.append(f"record {key.hex()} present at the end does not read back its bytes")
    r.present = len(ours)
    for key in ours:
        if key not in tried:
            r.problems.append(f"record {key.hex()} present that no writer put")
        entries = removals.get(key, [])
        if entries:
            r.problems.append(f"record {key.hex()} present after a tier reported it removed: {entries}")
    for j in writers:
        for key, acked_at in j.acked.items():
            why = _excused(key, acked_at, j, removals)
            if why == "deleted":
                r.deleted += 1
            elif why == "evicted":
                r.evicted += 1
            elif key not in intact:
                lost.setdefault(key, f"(batch {j.tried[key]}, sequence {acked_at}) acknowledged, gone at the end, "
                                     f"no removal explains it ({removals.get(key, [])})")
    r.lost = [f"{key.hex()}: {why}" for key, why in lost.items()]
    if r.peak_held_deleted_bytes > HELD_DELETED_SLACK_BYTES:
        r.problems.append(f"the writer held {r.peak_held_deleted_bytes} bytes of deleted files open")
    if r.peak_disk_bytes > DISK_BOUND_BYTES:
        r.problems.append(f"disk bytes peaked at {r.peak_disk_bytes} > {DISK_BOUND_BYTES}")
    if r.peak_fds > r.base_fds + FD_SLACK:
        r.problems.append(f"the writer's open descriptors grew from {r.base_fds} to {r.peak_fds}")


async def _read(tier, keys, bufs):
    return await tier.get_many_into([(k, memoryview(b)) for k, b in zip(keys, bufs)])
