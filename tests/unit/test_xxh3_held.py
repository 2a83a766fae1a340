"""XXH3-128 hashed in calls that keep the GIL: equal to xxhash's digest, and no other Python
thread runs while it hashes."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers import xxh3_held
from kvtier.tiers.record_layout import checksum


def _as(kind: str, data: bytes) -> "bytes | bytearray | memoryview":
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "readonly":
        return memoryview(data)
    return np.frombuffer(bytearray(data), dtype=np.uint8).data  # a writable numpy buffer


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=5000), st.sampled_from(["bytes", "bytearray", "readonly", "numpy"])),
                max_size=6))
def test_the_digest_of_parts_is_xxhash_s_digest_of_their_concatenation(parts: list) -> None:
    views = [_as(kind, data) for data, kind in parts]
    assert xxh3_held.xxh3_128_digest(*views) == xxhash.xxh3_128(b"".join(d for d, _ in parts)).digest()


def test_a_record_checksum_is_xxh3_128_over_the_key_s_length_key_prefix_header_and_payload() -> None:
    key, prefix, header, payload = b"key-1", b"KVTR\x01\x00\x20\x00\x00\x00", b"h" * 40, bytes(range(256)) * 4096
    expected = xxhash.xxh3_128(len(key).to_bytes(4, "little") + key + prefix + header + payload).digest()
    assert checksum(key, prefix, header, memoryview(payload)[:1000], memoryview(payload)[1000:]) == expected


def test_the_binding_is_taken_here_and_a_hasher_that_disagrees_with_xxhash_is_refused() -> None:
    assert xxh3_held.HOLDS_GIL
    assert xxh3_held._self_check(xxh3_held._released_digest)
    assert not xxh3_held._self_check(lambda *parts: bytes(16))


def test_a_non_contiguous_buffer_is_refused_as_xxhash_refuses_it() -> None:
    strided = memoryview(bytearray(64))[::2]
    with pytest.raises((ValueError, BufferError, TypeError)):
        xxhash.xxh3_128(strided)
    with pytest.raises((ValueError, BufferError, TypeError)):
        xxh3_held.xxh3_128_digest(strided)


def test_no_other_python_thread_runs_while_a_large_buffer_is_hashed() -> None:
    # A thread that stamps the clock in a loop: while the GIL is held through the hash it cannot
    # run, so its stamps show a gap about as long as the call (xxhash's own functions release the
    # GIL, and the stamps then continue through the call).
    data = bytes(256 << 20)  # about 10 ms of hashing, ten switch intervals
    stamps: list = []
    stop = threading.Event()

    def stamp() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    stamper = threading.Thread(target=stamp)
    stamper.start()
    try:
        time.sleep(0.02)
        start = time.perf_counter()
        xxh3_held.xxh3_128_digest(data)
        end = time.perf_counter()
        time.sleep(0.02)
    finally:
        stop.set()
        stamper.join()
        sys.setswitchinterval(old_interval)
    inside = [start] + [t for t in stamps if start < t < end] + [end]
    longest_gap = max(b - a for a, b in zip(inside, inside[1:]))
    # The stamper may still run for a switch interval (1 ms here) in the Python around the C call.
    assert longest_gap >= 0.6 * (end - start), (end - start, longest_gap)
