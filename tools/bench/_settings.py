"""The bench's sizes, budgets and targets, in one place (units in the names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from kvtier.engine.spill import BATCHES_IN_FLIGHT

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
SIZES: Tuple[int, ...] = (256 * KiB, 1 * MiB, 4 * MiB)
# Bytes a paired round moves: 4 of the spill's 64 MiB batches, so a round reaches the steady state
# of the tier's pipelined writes (and the engine's spill) in both runs; the quick run has fewer
# rounds, not shorter ones (shorter rounds measured another thing: 0.38x where the full run gave 0.81x).
ROUND_BYTES = 256 * MiB
# Paired rounds per chunk size (see run_paired): the full run's and the quick run's. Three, not two:
# a median of two rounds is their mean, so one round that met a stall of this shared disk (single
# rounds measured 2-5x off the others) moves it by half its excursion; a median of three ignores
# it, as the full run's median of four does. In two full runs, the first three rounds' median was
# within 15% of all four's in 73 and 84 of 90 paired rows, the first two rounds' in 59 and 47.
ROUNDS = 4
QUICK_ROUNDS = 3
QUICK_TOTAL_BYTES = QUICK_ROUNDS * ROUND_BYTES
FULL_TOTAL_BYTES = ROUNDS * ROUND_BYTES
# What the engine's spill puts in one LMDB transaction (EngineConfig defaults).
BATCH_BYTES = 64 * MiB
BATCH_MAX_CHUNKS = 256
# The staging geometry: bf16, 16-token blocks, 4 layers, K and V stacked, 128-wide heads.
LAYERS = 4
BLOCK_TOKENS = 16
HEAD_DIM = 128
BLOCK_UNIT = LAYERS * 2 * BLOCK_TOKENS * HEAD_DIM * 2  # bytes of one head of one block, all layers
# The targets README's benchmark tables list (ratios).
TARGET_SPILL_VS_RAW = 0.9
TARGET_SMALL_SPILL_VS_BASELINE = 2.0
TARGET_RESTORE_VS_RAW = 0.8
TARGET_STAGING_VS_MEMCPY = 0.9
TARGET_RELEASE_VS_STAGING = 0.8  # engine store until released vs the bare staging copy
TARGET_BOOKKEEPING_US = 20.0
TARGET_LONGEST_HIT_MS = 2.0
# Coverage figures count bytes at this many KV bytes per token and group (ratios do not depend on it).
COVERAGE_TOKEN_BYTES = 1024
COVERAGE_TOKENS = 100_000
LONGEST_HIT_TOKENS = 131072
BASELINE_FILES_IN_FLIGHT = 256
# The tier figures drive the tiers as the engine's spill does: this many batches in flight.
SPILL_BATCHES_IN_FLIGHT = BATCHES_IN_FLIGHT


def label_of(nbytes: int) -> str:
    if nbytes % MiB == 0:
        return f"{nbytes // MiB}MiB"
    if nbytes % KiB == 0:
        return f"{nbytes // KiB}KiB"
    return f"{nbytes}B"


def mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")


@dataclass(frozen=True)
class RunPlan:
    """What a run measures per chunk size, quick or full: the paired rounds (each ``round_bytes``,
    the subjects in one order: raw, kvtier's tiers, ``peers`` when true, the engine), and the
    engine's store until released, paired against the staging copy in ``rounds`` rounds of the
    same length. A quick run is the full run's plan with fewer rounds (and no busy repeat, which
    runs after the quiet rounds): its ratios estimate the same figures, less precisely."""

    sizes: Tuple[int, ...]
    round_bytes: int
    rounds: int
    peers: bool
    busy: Tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return self.rounds * self.round_bytes


def run_plan(quick: bool) -> RunPlan:
    """The default plan of ``kvtier bench`` (``--quick`` or not)."""
    return RunPlan(SIZES, ROUND_BYTES, QUICK_ROUNDS if quick else ROUNDS, True, () if quick else ("threads",))
