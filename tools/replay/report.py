"""What a replay found, as numbers: hit rates per tier, with and without warm-up, bytes per tier.

Primitives: ``summarize`` (one ``Outcome`` -> a dict of plain numbers), ``format_report`` (the
table), ``paired_bootstrap`` (a confidence interval of a hit-rate difference, resampling
requests), ``plot_sweep`` (a PNG of hit rate against budget; needs matplotlib). Pure but for the
plot's file; any thread.

Hit rates are token-weighted: hit tokens over input tokens. Per tier, a request's hit tokens are
split in proportion to the bytes each tier served it, so the tiers add up to the total.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .sim import Outcome

# A result or a sweep row: the JSON object `kvtier replay --json` prints. Its values are of many
# kinds (counts, rates, nested tables), read back by key, so they are typed Any.
JsonObject = Dict[str, Any]

__all__ = ["summarize", "format_report", "paired_bootstrap", "plot_sweep", "tier_hit_tokens"]


def tier_hit_tokens(outcome: Outcome) -> Dict[str, np.ndarray]:
    """Per tier, the hit tokens of each request it served (split by bytes read)."""
    total = sum(outcome.read_bytes.values())
    hits = outcome.hit_tokens.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {tier: np.where(total > 0, hits * read / np.maximum(total, 1), 0.0) for tier, read in outcome.read_bytes.items()}


def _rates(outcome: Outcome, start: int) -> Tuple[float, Dict[str, float]]:
    tokens = int(outcome.input_tokens[start:].sum())
    if not tokens:
        return 0.0, {tier: 0.0 for tier in outcome.read_bytes}
    by_tier = {tier: float(v[start:].sum()) / tokens for tier, v in tier_hit_tokens(outcome).items()}
    return float(outcome.hit_tokens[start:].sum()) / tokens, by_tier


def summarize(outcome: Outcome, *, warmup_fraction: float = 0.1, wall_s: Optional[float] = None) -> JsonObject:
    """The figures of one run; ``hit_rate`` is a fraction of input tokens."""
    n = len(outcome.hit_tokens)
    start = int(n * warmup_fraction)
    total, by_tier = _rates(outcome, 0)
    warm, warm_by_tier = _rates(outcome, start)
    out: JsonObject = {
        "mode": outcome.mode,
        "requests": n,
        "input_tokens": int(outcome.input_tokens.sum()),
        "hit_rate": total,
        "hit_rate_by_tier": by_tier,
        "hit_rate_after_warmup": warm,
        "hit_rate_by_tier_after_warmup": warm_by_tier,
        "warmup_requests": start,
        "prefill_tokens_saved": int(outcome.hit_tokens.sum()),
        "bytes_stored_per_request": float(outcome.stored_bytes.mean()) if n else 0.0,
        "tiers": {name: counts.as_dict() for name, counts in outcome.tiers.items()},
        "dropped_stores": dict(outcome.dropped_stores),
    }
    out.update(outcome.extra)
    if wall_s is not None:
        out["wall_s"] = wall_s
        ops = outcome.extra.get("engine_ops")
        out["ops_per_s"] = (ops if ops is not None else 3 * n) / wall_s if wall_s > 0 else 0.0
    return out


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.1f} MiB"


def format_report(result: JsonObject) -> str:
    """The readable table of ``run_replay``'s result."""
    lines = [f"kvtier replay: {result['trace']} ({result['trace_format']}), {result['requests']} requests, "
             f"{result['input_tokens']:,} input tokens"]
    if not result.get("prefix_sharing", True):
        lines.append("  this trace has no prefix ids (arrivals and lengths only): nothing is shared, hit rates are 0")
    lines.append(f"  layout   {result['layout']}")
    lines.append(f"  budgets  host {_mib(result['host_bytes'])} ({result['host_slots']} slots per group), "
                 + (f"disk {_mib(result['disk_bytes'])}" if result.get("disk_bytes") is not None else
                    "disk unbounded" if result.get("disk") else "no disk tier")
                 + f"; unique bytes {_mib(result['unique_bytes'])}; retention {result['retention']}, policy {result['policy']}")
    header = f"  {'run':<16}{'hit rate':>9}{'host':>8}{'disk':>8}{'remote':>8}   {'after warm-up':>13}"
    lines += ["", header]
    runs: List[JsonObject] = [result["main"]] + [r for r in (result.get("simulate"), *result.get("references", {}).values()) if r]
    for run in runs:
        tiers = run["hit_rate_by_tier"]
        cell = lambda t: f"{tiers[t]:>8.1%}" if t in tiers else f"{'-':>8}"  # noqa: E731
        lines.append(f"  {run['mode']:<16}{run['hit_rate']:>9.1%}{cell('host')}{cell('disk')}{cell('remote')}   "
                     f"{run['hit_rate_after_warmup']:>13.1%}")
    main = result["main"]
    versus = result.get("vs_reference_lru")
    if versus is not None:
        ratio = "-" if versus["ratio"] is None else f"{versus['ratio']:.2f}x"
        lines.append(f"  {main['mode']} against reference-lru: {ratio}, {versus['points']:+.2f} points")
    lines.append("")
    for name, t in main["tiers"].items():
        lines.append(f"  {name:<6} stored {t['stored_chunks']:,} chunks / {_mib(t['stored_bytes'])}, evicted "
                     f"{t['evicted_chunks']:,} / {_mib(t['evicted_bytes'])}, read {t['read_chunks']:,} / {_mib(t['read_bytes'])}")
    lines.append(f"  prefill tokens saved {main['prefill_tokens_saved']:,}; stored {_mib(main['bytes_stored_per_request'])} per request")
    if main.get("dropped_stores"):
        lines.append("  chunks dropped, by reason: " + ", ".join(f"{k} {v:,}" for k, v in main["dropped_stores"].items()))
    if "chunks_verified" in main:
        lines.append(f"  chunks verified {main['chunks_verified']:,}, wrong bytes {main['wrong_bytes']}")
    if result.get("agreement_points") is not None:
        lines.append(f"  engine vs fast mode: {result['agreement_points']:+.3f} points"
                     + (" (the fast mode and the references have no remote tier: they are not expected to agree)"
                        if result.get("remote") else ""))
    lines.append(f"  wall {main.get('wall_s', 0):.1f} s, {main.get('ops_per_s', 0):,.0f} engine ops/s"
                 if "engine_ops" in main else f"  wall {result.get('wall_s', 0):.1f} s")
    return "\n".join(lines)


def paired_bootstrap(hits_a: np.ndarray, hits_b: np.ndarray, tokens: np.ndarray, *, samples: int = 1000,
                     seed: int = 0, confidence: float = 0.95) -> Tuple[float, float, float]:
    """(difference, low, high): the token-weighted hit rate of ``a`` minus ``b`` over the same
    requests, and its percentile interval from resampling requests with replacement."""
    diff = (hits_a.astype(np.float64) - hits_b.astype(np.float64))
    tokens = tokens.astype(np.float64)
    point = float(diff.sum() / tokens.sum())
    rng = np.random.default_rng(seed)
    n = len(tokens)
    estimates = np.empty(samples)
    step = max(1, (1 << 22) // max(n, 1))
    for start in range(0, samples, step):
        rows = min(step, samples - start)
        picks = rng.integers(0, n, size=(rows, n))
        estimates[start:start + rows] = diff[picks].sum(axis=1) / tokens[picks].sum(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(estimates, [tail, 1 - tail])
    return point, float(low), float(high)


def plot_sweep(rows: Sequence[JsonObject], path: str) -> None:
    """Hit rate against budget, one line per (layout, R, retention), to ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'kvtier[plot]')") from None
    layouts = sorted({str(r["layout"]) for r in rows})
    figure, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 4), squeeze=False)
    for axis, name in zip(axes[0], layouts):
        lines: Dict[Tuple[object, object], List[Tuple[float, float]]] = {}
        for row in rows:
            if row["layout"] == name:
                lines.setdefault((row["R"], row["retention"]), []).append((float(row["budget"]), float(row["hit_rate"])))
        for (r, retention), points in sorted(lines.items(), key=str):
            points.sort()
            axis.plot([100 * p for p, _ in points], [100 * h for _, h in points], marker="o",
                      label=f"R={r}, retention={retention}")
        axis.set_xscale("log")
        budgets = sorted({100 * float(r["budget"]) for r in rows if r["layout"] == name})
        axis.set_xticks(budgets)
        axis.set_xticklabels([f"{b:g}%" for b in budgets])
        axis.minorticks_off()
        axis.set_xlabel("host and disk budget, share of unique bytes")
        axis.set_ylabel("token hit rate, %")
        axis.set_title(name)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
