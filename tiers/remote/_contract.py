"""The contract records (``Removal``, ``KeySnapshot``, ``TierStatistics``) from ``tiers/base.py``.

Temporary: until the tier contract lands in ``tiers/base.py``, the same records are defined here
with the agreed field names, so the remote and chained tiers build against the spec.
"""

from __future__ import annotations

try:  # pragma: no cover - which branch runs depends on the checkout
    from ..base import KeySnapshot, Removal, TierStatistics  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    from dataclasses import dataclass, field, fields
    from typing import Dict, FrozenSet, Mapping, Optional

    @dataclass(frozen=True)
    class Removal:  # type: ignore[no-redef]
        key: bytes
        sequence: int
        reason: str

    @dataclass(frozen=True)
    class KeySnapshot:  # type: ignore[no-redef]
        keys: FrozenSet[bytes]
        sequence: int

    @dataclass(frozen=True)
    class TierStatistics:  # type: ignore[no-redef]
        records: int = 0
        bytes: int = 0
        capacity_bytes: Optional[int] = None
        puts: int = 0
        put_batches: int = 0
        gets: int = 0
        hits: int = 0
        misses: int = 0
        corrupt: int = 0
        mismatched: int = 0
        quarantined: int = 0
        evictions: int = 0
        deletes: int = 0
        errors: int = 0
        degraded: bool = False
        extra: Mapping[str, float] = field(default_factory=dict)

        def as_dict(self) -> Dict[str, float]:
            out: Dict[str, float] = {}
            for f in fields(self):
                if f.name == "extra":
                    continue
                value = getattr(self, f.name)
                out[f.name] = float(value or 0)
            out.update({k: float(v) for k, v in self.extra.items()})
            return out

__all__ = ["KeySnapshot", "Removal", "TierStatistics"]
