"""The engine's ordered disk index: an add never overtakes a removal that
happened after the write, by the tier's sequence (tier contract) or, without one, by the engine's
own clock on the loop."""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.engine.disk_index import DiskIndex, keys_of

K, L = b"k" * 32, b"l" * 32


def test_a_removal_reported_before_the_put_answer_wins_without_sequences():
    index = DiskIndex()
    token = index.begin()  # put of K begins
    index.remove(K)  # its record is evicted before the answer reaches the loop
    assert index.add(K, token) is False
    index.end(token)
    assert K not in index


def test_by_sequence_a_later_write_wins_and_an_older_removal_loses():
    index = DiskIndex()
    token = index.begin()
    index.remove(K, sequence=5)  # the removal of an older record of K...
    assert index.add(K, token, sequence=7)  # ...is overtaken by the put that returned 7
    index.end(token)
    assert K in index
    assert index.remove(K, sequence=6) is False  # late report of a removal before the write
    assert K in index
    assert index.remove(K, sequence=8) is True
    assert K not in index


def test_by_sequence_a_removal_after_the_write_wins():
    index = DiskIndex()
    token = index.begin()
    index.remove(K, sequence=9)
    assert index.add(K, token, sequence=7) is False
    index.end(token)
    assert K not in index


def test_refresh_keeps_keys_added_during_the_listing_and_drops_keys_removed_during_it():
    removed = []
    index = DiskIndex(on_removed=removed.append)
    index.replace_all([K])
    token = index.begin()  # the listing starts: it will hold K and L
    index.remove(L)  # L is evicted while the listing runs
    spill = index.begin()
    assert index.add(b"m" * 32, spill)  # a spill lands while the listing runs, not in it
    index.end(spill)
    added, gone = index.refresh([K, L], token)
    index.end(token)
    assert (added, gone) == (0, 0)
    assert index.keys() == {K, b"m" * 32}


def test_refresh_drops_keys_another_process_removed():
    removed = []
    index = DiskIndex(on_removed=removed.append)
    index.replace_all([K, L])
    token = index.begin()
    assert index.refresh([K], token) == (0, 1)
    index.end(token)
    assert index.keys() == {K} and removed == [L]


def test_a_snapshot_sequence_places_removals_exactly():
    index = DiskIndex()
    token = index.begin()
    index.remove(K, sequence=3)  # reflected in a snapshot at 4: K was rewritten after it
    assert index.refresh([K], token, sequence=4) == (1, 0)
    index.end(token)
    assert K in index


def test_removals_are_forgotten_once_no_operation_can_race_with_them():
    index = DiskIndex()
    index.remove(K)
    assert not index._removed  # nothing in flight: nothing to remember
    token = index.begin()
    index.remove(K)
    assert index._removed
    index.end(token)
    assert not index._removed


def test_removal_reports_of_either_shape():
    assert keys_of([K, SimpleNamespace(key=L, sequence=4)]) == [(K, None), (L, 4)]
