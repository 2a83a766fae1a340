"""Disk-write admission: which newly stored chunks are worth a write to the disk tier.

Primitives: ``Admission`` (the interface: ``decide(keys)`` answers, key by key, whether each may be
written, then remembers them), ``AdmitAll`` (``all``: every chunk is written, the engine's behaviour
before admission existed), ``SeenBefore`` (``seen``: only a chunk stored once before, evicted from
every tier since, and stored again), ``make_admission(name, host_chunks, disk_chunks)``,
``tier_chunks`` and
``ADMISSION_NAMES``. Pure bookkeeping, no I/O. Not thread-safe: the engine calls it from its
event-loop thread only (its store path), replay's fast mode from its one thread.

Why: most chunks of a prefix cache are stored once and never read (75.9% of the Mooncake
conversation trace's unique blocks are used once). Written through to a disk of the host's
size, they fill the disk with the same chunks the host holds, so the two tiers' union is one
tier's worth of capacity. A chunk that comes back after both tiers let it go has proved reuse;
writing only those makes the disk keep chunks the host does not, TinyLFU's doorkeeper (Einziger
et al., 2017) applied to the host -> disk edge. A refused chunk stays on the host only, as a chunk
a full disk refuses does.
"""

from __future__ import annotations

import abc
from typing import Dict, Hashable, Iterable, List, Sequence, Tuple, Type

import xxhash

__all__ = ["Admission", "AdmitAll", "SeenBefore", "make_admission", "tier_chunks", "ADMISSION_NAMES", "WINDOW_FACTOR",
           "MAX_DISK_TO_HOST"]

# Keys remembered per generation, as a multiple of the chunks host and disk hold together. 4: on
# the first half of the conversation trace (where variants were tried) 4x kept 1.92x LRU at 2% of
# the unique bytes against 1.76x for 10x and 2.08x for 2x, and tied both at 5% and above.
WINDOW_FACTOR = 4

# `seen` holds while the disk is at most this many times the host, in chunks (see make_admission).
# 1: on the first half of the conversation trace, with the disk twice the host, `seen` gained 1.19
# points at 5% / 10% of the unique bytes but lost 1.02 at 10% / 20%; at 4x, 5.70 points at 5% / 20%.
MAX_DISK_TO_HOST = 1

# The disk is counted at the mean payload size while its capacity counts records, each with its
# header: budgets of equal bytes then give the disk a few more chunks than the host. A disk up to
# 1/16 past the ratio (headers of up to 1/16 of a chunk) still counts as within it.
RECORD_HEADER_SLACK = 16

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: spreads sequential ids (replay's chunk ids) over the bits


class Admission(abc.ABC):
    """Whether a newly stored chunk may be written to the disk tier. ``decide(keys)``: one answer
    per key, all taken before any of them is remembered (the keys of one store are new content,
    so none admits another); then the keys are remembered as stored."""

    name: str = "admission"

    @abc.abstractmethod
    def decide(self, keys: Sequence[Hashable]) -> List[bool]:
        """Per key, whether it may be written; then remember every key as stored once."""


class AdmitAll(Admission):
    """Every chunk is written (write-through)."""

    name = "all"

    def decide(self, keys: Sequence[Hashable]) -> List[bool]:
        return [True] * len(keys)


class SeenBefore(Admission):
    """Admit a key stored before (see the module docstring), remembered in two Bloom-filter
    generations of ``window`` keys each: when the current one has taken ``window`` keys it becomes
    the old one and a new one starts, so a key is remembered for between ``window`` and
    ``2 * window`` stores after its last one and memory stays at ``2 * window * bits_per_key``
    bits whatever the trace. A false positive (about 0.5% at 16 bits and 4 probes per key across
    both generations) admits a chunk that was not seen: a write-through, never a lost hit."""

    name = "seen"

    def __init__(self, window: int, bits_per_key: int = 16) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.window = window
        self._bits = max(64, window * bits_per_key)
        self._current = bytearray((self._bits + 7) // 8)
        self._old = bytearray(len(self._current))
        self._taken = 0

    def _positions(self, key: object) -> Tuple[int, int, int, int]:
        # Four probes by double hashing (Kirsch & Mitzenmacher): as good as four hash functions.
        h = (_stable_hash(key) * _GOLDEN) & _MASK64
        bits = self._bits
        step = (h >> 32) | 1
        first = h % bits
        return first, (first + step) % bits, (first + 2 * step) % bits, (first + 3 * step) % bits

    @staticmethod
    def _has(filt: bytearray, p: Tuple[int, int, int, int]) -> bool:
        a, b, c, d = p
        return bool(filt[a >> 3] >> (a & 7) & 1 and filt[b >> 3] >> (b & 7) & 1
                    and filt[c >> 3] >> (c & 7) & 1 and filt[d >> 3] >> (d & 7) & 1)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is remembered (stored within the last one or two windows)."""
        positions = self._positions(key)
        return self._has(self._current, positions) or self._has(self._old, positions)

    def decide(self, keys: Sequence[Hashable]) -> List[bool]:
        spots = [self._positions(key) for key in keys]
        has, current, old = self._has, self._current, self._old
        answers = [has(current, p) or has(old, p) for p in spots]
        for a, b, c, d in spots:
            if self._taken >= self.window:
                self._old, self._current = self._current, bytearray(len(self._current))
                self._taken = 0
            current = self._current
            current[a >> 3] |= 1 << (a & 7)
            current[b >> 3] |= 1 << (b & 7)
            current[c >> 3] |= 1 << (c & 7)
            current[d >> 3] |= 1 << (d & 7)
            self._taken += 1
        return answers


def _stable_hash(key: object) -> int:
    """A key's hash, the same in every process: Python salts ``hash`` of bytes per process
    (PYTHONHASHSEED), which made the engine's false positives, and so its disk writes and hit
    rate, change from one run of a trace to the next. Bytes keys (the engine's) by xxh3; ints
    (replay's chunk ids) are their own hash; other keys fall back to ``hash``."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        return xxhash.xxh3_64_intdigest(key)
    if isinstance(key, int):
        return key
    return hash(key)


_ADMISSIONS: Dict[str, Type[Admission]] = {AdmitAll.name: AdmitAll, SeenBefore.name: SeenBefore}
ADMISSION_NAMES: Tuple[str, ...] = tuple(sorted(_ADMISSIONS))


def make_admission(name: str, host_chunks: int, disk_chunks: int) -> Admission:
    """The admission ``name`` for a host of ``host_chunks`` chunks over a disk of ``disk_chunks``
    (``tier_chunks``). ``seen`` remembers ``WINDOW_FACTOR`` times their sum per generation, and
    holds only while the disk is at most ``MAX_DISK_TO_HOST`` times the host: a first use of a
    chunk refused by the disk must come within the host's reach, and past that ratio the disk's
    reach is the larger one (write-through is then ``AdmitAll``). Unknown ``name``: ValueError
    listing the valid names."""
    if name == SeenBefore.name:
        if RECORD_HEADER_SLACK * disk_chunks > (RECORD_HEADER_SLACK + 1) * MAX_DISK_TO_HOST * host_chunks:
            return AdmitAll()
        return SeenBefore(max(1, WINDOW_FACTOR * (int(host_chunks) + int(disk_chunks))))
    if name == AdmitAll.name:
        return AdmitAll()
    raise ValueError(f"unknown disk admission {name!r}; valid names: {', '.join(repr(n) for n in ADMISSION_NAMES)}")


def tier_chunks(host_slots: Iterable[int], disk_capacity_bytes: int, chunk_bytes: Sequence[int]) -> Tuple[int, int]:
    """(host chunks, disk chunks), as the engine and replay's fast mode count them for
    ``make_admission``: every host slot, and the disk's capacity at the mean chunk size."""
    mean = sum(chunk_bytes) / max(1, len(chunk_bytes))
    return sum(host_slots), int(disk_capacity_bytes // max(1.0, mean))
