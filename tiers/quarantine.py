"""Quarantine of corrupt records, shared by the disk tiers: keep some evidence, never fill the disk.

A record that fails its checksum is taken out of service at once (a miss from then on) and kept
for inspection in the tier's quarantine (LMDB: the ``quarantine`` table; files: ``quarantine/``),
at most ``max_records`` of them; past that it is deleted instead, so a disk that corrupts
everything cannot fill the cache with evidence.

Primitive: ``QuarantineRoom`` -- how many more records the quarantine keeps; not thread-safe (each
tier uses it from the one thread that moves records).
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_QUARANTINE_RECORDS", "QuarantineRoom", "check_max_quarantine_records"]

# Enough to see a pattern (which keys, which bytes), small enough to never matter for capacity.
DEFAULT_MAX_QUARANTINE_RECORDS = 64


def check_max_quarantine_records(value: object) -> int:
    """The constructor check both tiers apply: an int >= 0 (0: keep none, delete at once)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_quarantine_records must be an int >= 0, got {value!r}")
    return value


class QuarantineRoom:
    """``take()`` says whether the next corrupt record is kept (True) or deleted (False)."""

    __slots__ = ("max_records", "held")

    def __init__(self, max_records: int, held: int) -> None:
        self.max_records = max_records
        self.held = held

    def take(self) -> bool:
        if self.held >= self.max_records:
            return False
        self.held += 1
        return True
