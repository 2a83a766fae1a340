"""Disk-write admission (``tiers.admission``) against a brute-force oracle.

The oracle keeps the two generations of ``SeenBefore`` as exact sets of keys and rotates them at
the same counts; the Bloom filters may only add admissions to it (false positives), never drop
one (a false negative would keep a proven chunk off the disk), and only rarely add one.
"""

from __future__ import annotations

from typing import List, Set

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.admission import (ADMISSION_NAMES, MAX_DISK_TO_HOST, WINDOW_FACTOR, AdmitAll, SeenBefore,
                                    make_admission, tier_chunks)


class SeenOracle:
    def __init__(self, window: int) -> None:
        self.window, self.current, self.old, self.taken = window, set(), set(), 0

    def decide(self, keys: List[object]) -> List[bool]:
        answers = [key in self.current or key in self.old for key in keys]
        for key in keys:
            if self.taken >= self.window:
                self.old, self.current, self.taken = self.current, set(), 0
            self.current.add(key)
            self.taken += 1
        return answers


STORES = st.lists(st.lists(st.one_of(st.integers(0, 60), st.binary(min_size=1, max_size=4)), max_size=8), max_size=80)


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 12), stores=STORES)
def test_seen_before_admits_every_key_the_oracle_admits(window, stores):
    real, oracle = SeenBefore(window), SeenOracle(window)
    for keys in stores:
        got, want = real.decide(keys), oracle.decide(keys)
        assert all(g for g, w in zip(got, want) if w), (keys, got, want)
        assert len(got) == len(keys)


def test_seen_before_false_positives_are_rare_and_old_keys_are_forgotten():
    window = 4096
    real, oracle = SeenBefore(window), SeenOracle(window)
    extra = total = 0
    for start in range(0, 40 * window, 64):
        keys = list(range(start, start + 64)) + list(range(start - 3 * window, start - 3 * window + 8))
        got, want = real.decide(keys), oracle.decide(keys)
        extra += sum(g and not w for g, w in zip(got, want))
        total += len(keys)
        assert all(g for g, w in zip(got, want) if w)
    # Keys from three windows back were forgotten by both: each such answer was a false positive.
    assert extra / total < 0.01


def test_one_store_never_admits_its_own_keys_and_a_repeat_is_admitted():
    seen = SeenBefore(16)
    assert seen.decide([b"a", b"a", b"b"]) == [False, False, False]
    assert seen.decide([b"b", b"c"]) == [True, False]
    assert b"a" in seen and b"z" not in seen


def test_a_key_stored_two_windows_ago_is_forgotten():
    seen = SeenBefore(8, bits_per_key=256)  # no false positive at 8 keys in 2048 bits here
    seen.decide([b"old"])
    seen.decide([f"k{i}".encode() for i in range(7)])  # the first generation is full
    assert b"old" in seen
    seen.decide([f"m{i}".encode() for i in range(8)])  # now the old generation
    assert b"old" in seen
    seen.decide([b"n"])  # a third generation starts: the first one is dropped
    assert b"old" not in seen


def test_make_admission_by_name_and_its_window():
    assert ADMISSION_NAMES == ("all", "seen")
    assert isinstance(make_admission("all", 10, 10), AdmitAll)
    assert make_admission("all", 10, 10).decide([1, 2]) == [True, True]
    seen = make_admission("seen", 30, 10)
    assert isinstance(seen, SeenBefore) and seen.window == WINDOW_FACTOR * 40
    # A disk past MAX_DISK_TO_HOST times the host is written every chunk.
    assert isinstance(make_admission("seen", 10, 10 * MAX_DISK_TO_HOST), SeenBefore)
    assert isinstance(make_admission("seen", 10, 10 * MAX_DISK_TO_HOST + 1), AdmitAll)
    # Equal budgets in bytes give the disk a few more chunks (its records carry headers): within
    # 1/16 of the ratio the disk still counts as the host's size.
    assert isinstance(make_admission("seen", 16, 17 * MAX_DISK_TO_HOST), SeenBefore)
    assert isinstance(make_admission("seen", 16, 18 * MAX_DISK_TO_HOST), AdmitAll)
    with pytest.raises(ValueError, match=r"unknown disk admission 'tiny'; valid names: 'all', 'seen'"):
        make_admission("tiny", 10, 10)
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        SeenBefore(0)
    # Host slots, and the disk's bytes at the mean chunk size.
    assert tier_chunks([4, 6], 1000, [100, 300]) == (10, 5)


def test_seen_before_answers_the_same_in_every_process():
    """Bytes keys are hashed by xxh3, not by Python's ``hash`` (salted per process): a filter small
    enough for false positives gives the same answers under two hash seeds."""
    import os
    import subprocess
    import sys

    script = ("from kvtier.tiers.admission import SeenBefore\n"
              "s = SeenBefore(64, bits_per_key=2)\n"
              "s.decide([b'key-%d' % i for i in range(64)])\n"
              "print(''.join('1' if a else '0' for a in s.decide([b'other-%d' % i for i in range(200)])))\n")
    answers = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        answers.add(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip())
    assert len(answers) == 1
    (bits,) = answers
    assert len(bits) == 200 and 0 < bits.count("1") < 200  # false positives there are, and the same ones
