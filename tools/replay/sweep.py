"""``kvtier replay --sweep``: what MTP's extra retained tokens and the retention interval cost.

Primitives: ``SWEEP_R``, ``SWEEP_RETENTIONS``, ``SWEEP_BUDGETS``, ``run_sweep`` (rows of the fast
mode over ``R`` x retention x budget for some layouts), ``format_sweep`` (a Markdown table). Pure;
any thread.

Each budget is a share of the trace's unique bytes (every complete chunk of every group, counted
once), the same for every ``R`` and retention so rows compare at equal bytes; the host pool and
the disk tier both get it (the host is inclusive: the disk holds what the host holds, so the
hierarchy holds the budget). The difference against ``R = 0`` at the same retention and budget
comes with a paired bootstrap interval over requests.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

from .layouts import preset
from .report import JsonObject, paired_bootstrap
from .sim import Outcome, simulate_engine, simulate_lru
from .trace import Trace
from .workload import REPLAY_FINGERPRINT, Plans, Workload, host_slots, record_bytes

__all__ = ["SWEEP_R", "SWEEP_RETENTIONS", "SWEEP_BUDGETS", "SWEEP_LAYOUTS", "SWEEP_POLICY", "run_sweep", "format_sweep"]

SWEEP_R = (0, 1, 3)
SWEEP_RETENTIONS = (None, 0)
SWEEP_BUDGETS = (0.02, 0.05, 0.10, 0.20, 0.50)
SWEEP_LAYOUTS = ("gpt-oss-120b", "gemma-3-27b", "deepseek-v4")
# kvtier's engine with LRU on the host and the disk (not the host's default ARC): set beside the
# plain LRU, the difference is what the per-group pools and the hierarchy cost, not the policy.
SWEEP_POLICY = "lru"


def run_sweep(trace: Trace, *, layouts: Sequence[str] = SWEEP_LAYOUTS, budgets: Sequence[float] = SWEEP_BUDGETS,
              r_values: Sequence[int] = SWEEP_R, retentions: Sequence[Optional[int]] = SWEEP_RETENTIONS,
              bootstrap: int = 1000,
              progress: Optional[Callable[[int], None]] = None) -> List[JsonObject]:
    """One row per (layout, retention, budget, R): hit rate (the engine model with
    ``SWEEP_POLICY`` on the host and the disk, and ``lru_``: one plain LRU cache of the budget over
    the same chunks), bytes stored per request, and the deltas
    against ``R = r_values[0]`` with their 95% intervals."""
    rows: List[JsonObject] = []
    for name in layouts:
        base = preset(name, 0)  # nothing moves: the model's true bytes
        work = Workload.prepare(trace, base)
        chunk_bytes = base.all_chunk_bytes
        records = record_bytes(base, REPLAY_FINGERPRINT)
        unique = work.unique_bytes(chunk_bytes)
        for retention in retentions:
            for budget in budgets:
                outcomes: Dict[int, Outcome] = {}
                lrus: Dict[int, Outcome] = {}
                planned: Dict[int, Plans] = {}
                for r in r_values:
                    layout = preset(name, r)
                    started = time.perf_counter()
                    capacity = int(budget * unique)
                    plans = planned[r] = Plans(layout, retention)
                    slots = host_slots(capacity, chunk_bytes, plans)
                    same = next((q for q in planned if q != r and host_slots(capacity, chunk_bytes, planned[q]) == slots
                                 and same_plans(work, planned[q], plans)), None)
                    if same is not None:
                        # Every decision of both runs would be the same: reuse the earlier ones.
                        outcomes[r], lrus[r] = outcomes[same], lrus[same]
                    else:
                        outcomes[r] = simulate_engine(
                            work, plans, host_slots=slots, chunk_bytes=chunk_bytes,
                            disk_capacity=int(budget * work.unique_bytes(records)), disk_record_bytes=records,
                            policy=SWEEP_POLICY)
                        # The same chunks and bytes in one plain LRU cache of the budget: what R
                        # costs apart from how the engine splits its host pools.
                        lrus[r] = simulate_lru(work, plans, chunk_bytes=chunk_bytes, capacity=capacity)
                    outcome, lru = outcomes[r], lrus[r]
                    row: JsonObject = {
                        "layout": name, "R": r, "retention": "dense" if retention is None else retention,
                        "budget": budget, "hit_rate": outcome.hit_rate, "lru_hit_rate": lru.hit_rate,
                        "bytes_stored_per_request": float(outcome.stored_bytes.mean()),
                        "dropped_chunks": sum(outcome.dropped_stores.values()),
                        "seconds": time.perf_counter() - started,
                    }
                    if r != r_values[0]:
                        reference = outcomes[r_values[0]]
                        delta, low, high = paired_bootstrap(outcome.hit_tokens, reference.hit_tokens, outcome.input_tokens,
                                                            samples=bootstrap)
                        row.update(delta_points=100 * delta, delta_low=100 * low, delta_high=100 * high,
                                   stored_ratio=(row["bytes_stored_per_request"] /
                                                 max(1e-9, float(reference.stored_bytes.mean()))))
                        delta, low, high = paired_bootstrap(lru.hit_tokens, lrus[r_values[0]].hit_tokens, lru.input_tokens,
                                                            samples=bootstrap)
                        row.update(lru_delta_points=100 * delta, lru_delta_low=100 * low, lru_delta_high=100 * high)
                    rows.append(row)
                    if progress is not None:
                        progress(1)
    return rows


def same_plans(work: Workload, a: Plans, b: Plans) -> bool:
    """Whether two plans of one layout (another ``R``) make every replay decision on ``work`` the
    same: per sliding group, equal store and speculative chunks at every prompt length of the
    trace and equal load chunks (what ``longest_hit`` checks) at every hit length up to the
    longest prompt. (``R = 1`` with 16- or 64-token blocks: ``W - 1 + R`` tokens are the same
    blocks as ``W - 1``.) Full-attention groups do not depend on ``R``."""
    layout = a.layout
    granularity = layout.hit_granularity_tokens
    lengths = sorted(set(work.tokens))
    for g, group in enumerate(layout.groups):
        if group.sliding_window is None:
            continue
        if any(a.store(g, n) != b.store(g, n) or a.speculative(g, n) != b.speculative(g, n) for n in lengths):
            return False
        if any(a.load(g, h) != b.load(g, h) for h in range(granularity, lengths[-1] + 1, granularity)):
            return False
    return True


def format_sweep(rows: Sequence[JsonObject]) -> str:
    """The sweep as a Markdown table: one line per (layout, retention, budget), the first ``R``'s
    hit rate (kvtier's engine model and a plain LRU of the budget) and bytes stored per request,
    each other ``R``'s differences (95% interval) and bytes against it, and the chunks whose stores
    were dropped (host pools too small for one request)."""
    groups: Dict[tuple, List[JsonObject]] = {}
    for row in rows:
        groups.setdefault((row["layout"], row["retention"], row["budget"]), []).append(row)
    others = sorted({int(r["R"]) for r in rows})[1:]
    first = min(int(r["R"]) for r in rows)
    with_lru = all("lru_hit_rate" in r for r in rows)  # rows written before the LRU columns lack them
    header = ["layout", "retention", "budget", f"kvtier R={first}"] + ([f"LRU R={first}"] if with_lru else []) + ["stored/request"]
    for r in others:
        header += [f"R={r}: kvtier delta, points (95% CI)"] + ([f"R={r}: LRU delta"] if with_lru else []) + [f"R={r}: stored"]
    header.append("dropped chunks (per R)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (layout, retention, budget), items in groups.items():
        items = sorted(items, key=lambda r: int(r["R"]))
        base = items[0]
        cells = [str(layout), str(retention), f"{100 * float(budget):g}%", f"{100 * float(base['hit_rate']):.2f}%"]
        cells += [f"{100 * float(base['lru_hit_rate']):.2f}%"] if with_lru else []
        cells.append(f"{float(base['bytes_stored_per_request']) / (1 << 20):,.0f} MiB")
        for row in items[1:]:
            cells.append(f"{row['delta_points']:+.3f} ({row['delta_low']:+.3f}, {row['delta_high']:+.3f})")
            if with_lru:
                cells.append(f"{row['lru_delta_points']:+.3f} ({row['lru_delta_low']:+.3f}, {row['lru_delta_high']:+.3f})")
            cells.append(f"{row['stored_ratio']:.3f}x")
        cells.append(" / ".join(f"{int(r['dropped_chunks']):,}" for r in items))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
