"""The bench's report: rows (a figure, its ratio to a reference, a target verdict) and the table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["BenchRow", "BenchReport", "format_report", "ratio_of", "judge"]


@dataclass
class BenchRow:
    """One figure: ``value`` in ``unit``, and ``ratio`` = value / the figure named by ``ratio_to``
    (``None`` for a limit, which is its own reference). ``target`` / ``met``: the issue's target
    this row is judged by, if any."""

    name: str
    value: float
    unit: str
    ratio: Optional[float]
    ratio_to: Optional[str]
    target: Optional[str] = None
    met: Optional[bool] = None
    # A paired ratio's value in each round, in round order (``ratio`` is their median): how far
    # the rounds spread, and whether later rounds drift from the first ones (a quick run has fewer).
    per_round: Optional[List[float]] = None

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        for k in ("value", "ratio"):
            if isinstance(out[k], float):
                out[k] = round(out[k], 4)
        if out["per_round"] is None:
            del out["per_round"]
        else:
            out["per_round"] = [round(x, 4) for x in out["per_round"]]
        return out


@dataclass
class BenchReport:
    rows: List[BenchRow] = field(default_factory=list)
    machine: Dict[str, Any] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)

    def add(self, *args: Any, **kwargs: Any) -> BenchRow:
        row = BenchRow(*args, **kwargs)
        self.rows.append(row)
        return row

    def to_dict(self) -> Dict[str, Any]:
        return {"results": [r.to_dict() for r in self.rows], "machine": self.machine}


def ratio_of(value: float, reference: float) -> Optional[float]:
    return value / reference if reference and reference > 0 else None


def judge(row: BenchRow, minimum: Optional[float] = None, maximum: Optional[float] = None,
           on: str = "ratio") -> BenchRow:
    x = row.ratio if on == "ratio" else row.value
    if x is None:
        row.met = False
    elif minimum is not None:
        row.met = x >= minimum
    elif maximum is not None:
        row.met = x <= maximum
    return row


def format_report(report: BenchReport) -> str:
    """The table: name, value and unit, ratio to its reference, target verdict; then the machine."""
    lines = []
    width = max((len(r.name) for r in report.rows), default=10)
    for r in report.rows:
        value = f"{r.value:,.1f}" if abs(r.value) >= 10 else f"{r.value:.3g}"
        text = f"{r.name:<{width}}  {value:>10} {r.unit:<7}"
        if r.ratio is not None:
            text += f"  {r.ratio:6.2f}x {r.ratio_to}"
        elif r.ratio_to:
            text += f"  {'':7} {r.ratio_to}"
        if r.target is not None:
            text += f"  [target {r.target}: {'MET' if r.met else 'MISSED'}]"
        lines.append(text)
    targets = [r for r in report.rows if r.target is not None]
    met = sum(1 for r in targets if r.met)
    lines.append("")
    lines.append(f"targets: {met} of {len(targets)} met")
    for r in targets:
        if not r.met:
            lines.append(f"  MISSED: {r.name} ({r.target})")
    for failure in report.failures:
        lines.append(f"FAIL: {failure}")
    lines.append("machine: " + ", ".join(f"{k}={v}" for k, v in report.machine.items() if k != "noise"))
    return "\n".join(lines)
