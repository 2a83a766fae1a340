"""Paired rounds: every disk figure comes from the same rounds (see ``run_paired``).

The chunks are cut into ``rounds`` equal ranges and, round after round, each subject writes its
range (the reference first in even rounds, last in odd ones), and the page cache's dirty pages are
written back (``os.sync``, untimed) before the next subject writes; then, after a restart of what
has one, round after round the page cache is dropped and each subject reads its range back. A
subject's ratio to a reference is the median over rounds of (its speed / the reference's speed in
the same round): both saw the same disk, the same noisy neighbours and the same state of the VM's
memory within seconds of each other. Each row also lists the per-round ratios
(``PairedTimes.round_ratios``).

Why the writeback after each write: a subject that does not sync (the peers as shipped, without
their "+fsync" variants) leaves up to a round of dirty pages, which the kernel would write back during
the *next* subjects' timed rounds, charging one subject's writeback to another.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from ._machine import drop_page_cache
from ._settings import mb_s
from ._subjects import DiskSubject

__all__ = ["PairedTimes", "run_paired"]


def _zero(buffers: Sequence[memoryview]) -> None:
    for b in buffers:
        np.frombuffer(b, dtype=np.uint8).fill(0)


def _all_equal(a: Sequence[memoryview], b: Sequence[memoryview]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(np.frombuffer(x, dtype=np.uint8), np.frombuffer(y, dtype=np.uint8)) for x, y in zip(a, b)
    )


@dataclass
class PairedTimes:
    """Seconds per round of each subject, for writes and reads, and the bytes of each round."""

    round_bytes: List[int]
    write: Dict[str, List[float]]
    read: Dict[str, List[float]]

    def mb_s(self, name: str, kind: str) -> float:
        times = (self.write if kind == "write" else self.read)[name]
        return mb_s(sum(self.round_bytes), sum(times))

    def round_ratios(self, name: str, kind: str, reference: str) -> List[float]:
        """Per round, this subject's speed over the reference's in that round."""
        table = self.write if kind == "write" else self.read
        return [ref / own for own, ref in zip(table[name], table[reference])]

    def ratio(self, name: str, kind: str, reference: str) -> float:
        """Median over rounds of this subject's speed over the reference's, same round."""
        return statistics.median(self.round_ratios(name, kind, reference))


async def run_paired(subjects: Sequence[DiskSubject], rounds: Sequence[range], chunk_bytes: int,
                     outs: Sequence[memoryview], chunks: Sequence[memoryview],
                     say: Callable[[str], None] = lambda _: None) -> Tuple[PairedTimes, List[str]]:
    """Drive ``subjects`` through the write rounds, a restart, and the read rounds (see above)."""
    times = PairedTimes([len(r) * chunk_bytes for r in rounds], {s.name: [] for s in subjects},
                        {s.name: [] for s in subjects})
    failures: List[str] = []
    for s in subjects:
        await s.setup()
    try:
        for i, r in enumerate(rounds):
            say(f"write round {i + 1}/{len(rounds)}")
            for s in subjects if i % 2 == 0 else list(reversed(subjects)):
                times.write[s.name].append(await s.write(r))
                os.sync()  # its dirty pages are its own: never written back in another's round
        for s in subjects:
            await s.restart()
        paths = [p for s in subjects for p in s.paths()]
        for i, r in enumerate(rounds):
            say(f"read round {i + 1}/{len(rounds)}")
            drop_page_cache(paths)
            for s in subjects if i % 2 == 0 else list(reversed(subjects)):
                if s.checks_outs:
                    _zero([outs[j] for j in r])
                times.read[s.name].append(await s.read(r))
                if s.checks_outs and not _all_equal([chunks[j] for j in r], [outs[j] for j in r]):
                    failures.append(f"{s.name}: bytes read back differ from those written (round {i + 1})")
    finally:
        for s in subjects:
            try:
                failures.extend(await s.teardown())
            except Exception as exc:  # noqa: BLE001 - reported, the other subjects still close
                failures.append(f"{s.name}: teardown failed: {exc!r}")
    return times, failures
