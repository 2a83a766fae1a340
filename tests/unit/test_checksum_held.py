"""The read path's checksum (``tiers.checksum_held``): the same digest as the ``xxhash`` package's
streaming XXH3-128, for every payload kind a read hands it, with the C library and without."""

from __future__ import annotations

import mmap
import os

import pytest
import xxhash

from kvtier.tiers import checksum_held
from kvtier.tiers.record_layout import checksum, checksum_holding_gil


def _streamed(head: bytes, payload: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(payload)
    return h.digest()


def _payloads(data: bytes):
    page = mmap.mmap(-1, max(len(data), 1))
    page[: len(data)] = data
    yield memoryview(page)[: len(data)]  # writable, page-aligned: a host slot
    yield memoryview(bytearray(data))
    yield memoryview(data)  # read-only: an inline record in LMDB's map


@pytest.mark.parametrize("nbytes", [0, 1, 17, 4096, 65536 + 3, 1 << 20])
def test_digest_parts_matches_streamed_xxh3_128(nbytes: int) -> None:
    head, data = os.urandom(61), os.urandom(nbytes)
    for payload in _payloads(data):
        assert checksum_held.digest_parts(head, payload) == _streamed(head, data)


def test_the_library_is_found_here_and_the_fallback_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where this machine has no libxxhash the GIL-holding path is untested: say so by failing.
    assert checksum_held.HELD
    head, data = os.urandom(40), os.urandom(300_001)
    held = checksum_held.digest_parts(head, memoryview(data))
    monkeypatch.setattr(checksum_held, "_LIB", None)
    assert checksum_held.digest_parts(head, memoryview(data)) == held == _streamed(head, data)


def test_checksum_holding_gil_is_the_record_checksum() -> None:
    key, prefix, body, payload = os.urandom(32), os.urandom(10), os.urandom(70), os.urandom(200_000)
    assert checksum_holding_gil(key, prefix, body, memoryview(payload)) == checksum(key, prefix, body, payload)
    flipped = bytearray(payload)
    flipped[123_456] ^= 1
    assert checksum_holding_gil(key, prefix, body, memoryview(flipped)) != checksum(key, prefix, body, payload)
