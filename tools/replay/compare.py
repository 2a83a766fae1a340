"""``kvtier replay --compare-policies``: eviction policies side by side, with LRU and the offline bound.

Primitives: ``COMPARE_BUDGETS``, ``run_comparison`` (rows of the fast mode, one per layout x R x
budget x policy), ``format_comparison`` (a Markdown table). Pure; any thread.

Budgets as in ``--sweep``: a share of the trace's unique bytes given to the host pools and to the
disk tier alike. Each policy runs on both tiers (``simulate_engine``'s ``policy``: the host pools'
policy objects and the disk's byte index, the engine's own); its difference from the engine with
``lru`` comes with a paired bootstrap interval over requests. ``belady`` is the offline bound of
one cache of the budget over the same chunks.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from .layouts import preset
from .report import JsonObject, paired_bootstrap
from .sim import simulate_belady, simulate_engine
from .trace import Trace
from .workload import REPLAY_FINGERPRINT, Plans, Workload, host_slots, record_bytes

__all__ = ["COMPARE_BUDGETS", "run_comparison", "format_comparison"]

COMPARE_BUDGETS = (0.02, 0.05, 0.10)


def run_comparison(trace: Trace, *, policies: Sequence[str], layouts: Sequence[str], r_values: Sequence[int] = (0, 3),
                   budgets: Sequence[float] = COMPARE_BUDGETS, bootstrap: int = 1000,
                   progress: Optional[Callable[[int], None]] = None) -> List[JsonObject]:
    """One row per (layout, R, budget): each policy's hit rate, its ratio to and difference from
    ``lru`` (95% interval), and the Belady bound's hit rate."""
    rows: List[JsonObject] = []
    names = ["lru"] + [p for p in policies if p != "lru"]
    for name in layouts:
        base = preset(name, 0)
        work = Workload.prepare(trace, base)
        chunk_bytes = base.all_chunk_bytes
        records = record_bytes(base, REPLAY_FINGERPRINT)
        unique, unique_records = work.unique_bytes(chunk_bytes), work.unique_bytes(records)
        for r in r_values:
            plans = Plans(preset(name, r), None)
            for budget in budgets:
                capacity = int(budget * unique)
                row: JsonObject = {"layout": name, "R": r, "budget": budget}
                outcomes = {}
                for policy in names:
                    outcomes[policy] = simulate_engine(
                        work, plans, host_slots=host_slots(capacity, chunk_bytes, plans), chunk_bytes=chunk_bytes,
                        disk_capacity=int(budget * unique_records), disk_record_bytes=records, policy=policy)
                lru = outcomes["lru"]
                for policy, outcome in outcomes.items():
                    row[policy] = outcome.hit_rate
                    if policy != "lru":
                        delta, low, high = paired_bootstrap(outcome.hit_tokens, lru.hit_tokens, outcome.input_tokens,
                                                            samples=bootstrap)
                        row[f"{policy}_ratio"] = outcome.hit_rate / lru.hit_rate if lru.hit_rate else float("nan")
                        row[f"{policy}_delta"] = (100 * delta, 100 * low, 100 * high)
                row["belady"] = simulate_belady(work, plans, chunk_bytes=chunk_bytes, capacity=capacity).hit_rate
                rows.append(row)
                if progress is not None:
                    progress(1)
    return rows


def format_comparison(rows: Sequence[JsonObject], policies: Sequence[str]) -> str:
    """Markdown: layout, R, budget, LRU, each other policy (hit rate, x LRU, points with the 95%
    interval), the Belady bound."""
    others = [p for p in policies if p != "lru"]
    header = ["layout", "R", "budget", "lru"] + [f"{p}: hit, x lru, points (95% CI)" for p in others] + ["belady"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row["layout"]), str(row["R"]), f"{100 * float(row['budget']):g}%", f"{100 * float(row['lru']):.2f}%"]
        for p in others:
            delta, low, high = row[f"{p}_delta"]
            cells.append(f"{100 * float(row[p]):.2f}%, {float(row[f'{p}_ratio']):.2f}x, {delta:+.2f} ({low:+.2f}, {high:+.2f})")
        cells.append(f"{100 * float(row['belady']):.2f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
