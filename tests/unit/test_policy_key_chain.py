"""Key format v2 (docs/ARCHITECTURE.md, "Chunk keys"): golden vectors, the brute-force definition, laziness in any read order,
and incremental growth (``KeyChain.extended``) equal to hashing from scratch."""

from __future__ import annotations

import random
import struct

import pytest
from blake3 import blake3

from kvtier.policy import KEY_FORMAT_VERSION, AttentionGroup, KeyChain, ModelLayout, chunk_keys

# A DeepSeek-V4-like layout: FA 256-token chunks, SWA 64-token and 8-token chunks.
LAYOUT = ModelLayout(
    (
        AttentionGroup(64, blocks_per_chunk=4),
        AttentionGroup(64, sliding_window=128, extra_retained_tokens=3),
        AttentionGroup(8, sliding_window=128, extra_retained_tokens=3),
    )
)
FP = b"model=tiny;dtype=bf16;weights=v1"
SALT_CONTEXT = "kvtier 2026-11 tenant salt v1"


def brute_force_key(layout, tokens, fingerprint, salt, group, chunk):
    """The format written out from its definition (the module docstring), with nothing shared."""

    def part(tag, payload):
        return struct.pack("<BQ", tag, len(payload)) + payload

    geometry = struct.pack("<Q", len(layout.groups)) + b"".join(
        struct.pack("<QQ", g.block_size, g.tokens_per_chunk) for g in layout.groups
    )
    end = (chunk + 1) * layout.groups[group].tokens_per_chunk
    data = (
        part(1, b"kvtier.chunk-key.v2")
        + part(2, fingerprint)
        + part(3, b"\x01" if salt is not None else b"\x00")
        + part(7, geometry)
        + bytes([6])
        + struct.pack(f"<{end}I", *tokens[:end])
    )
    if salt is None:
        hasher = blake3(data)
    else:
        hasher = blake3(data, key=blake3(salt, derive_key_context=SALT_CONTEXT).digest())
    return hasher.digest(32, seek=32 * group)


def tokens_of(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(n)]


def test_format_version_is_2():
    assert KEY_FORMAT_VERSION == 2


GOLDEN = {
    "fa0": "16685762bcb61c48064ecb85956d1c92f290d1899e7cf86d43991769cb2ded54",
    "fa1": "9d345d5fd01d2f3d8581b379b018972009bc58ece7dedc60786bf4ffc69f675f",
    "swa64_8": "cbb775668af7f17a2b6ac66001013f0e692df72ae46ec63ce4f038681b12e439",
    "swa8_74": "430e91f90cc95cf492d0f06ca6434b8906ebaf26e56ba19527ef3d5fec0f7294",
    "salted_fa1": "cc48bae7c680b08226236922440ca630168f05070c9f5e3dccc667b4e60acc6d",
}


def test_golden_vectors():
    """Pinned bytes: a change here breaks every existing cache, so it must come with a new format
    version (and a note in README / ARCHITECTURE)."""
    tokens = list(range(1000, 1600))  # 600 tokens: 2 FA chunks, 9 of 64, 75 of 8
    plain = chunk_keys(LAYOUT, tokens, fingerprint=FP)
    salted = chunk_keys(LAYOUT, tokens, fingerprint=FP, salt=b"tenant-a")
    got = {
        "fa0": plain[0][0].hex(),
        "fa1": plain[0][1].hex(),
        "swa64_8": plain[1][8].hex(),
        "swa8_74": plain[2][74].hex(),
        "salted_fa1": salted[0][1].hex(),
    }
    assert got == GOLDEN


@pytest.mark.parametrize("salt", [None, b"tenant-a"])
def test_every_key_equals_the_brute_force_definition(salt):
    tokens = tokens_of(2600)
    result = chunk_keys(LAYOUT, tokens, fingerprint=FP, salt=salt)
    assert [len(g) for g in result] == [2600 // 256, 2600 // 64, 2600 // 8]
    for g, group in enumerate(result):
        for c in range(len(group)):
            assert group[c] == brute_force_key(LAYOUT, tokens, FP, salt, g, c), (g, c)


def test_lazy_reads_in_any_order_match_eager_keys():
    tokens = tokens_of(5000, seed=1)
    eager = chunk_keys(LAYOUT, tokens, fingerprint=FP)
    rng = random.Random(2)
    for _ in range(3):
        chain = KeyChain(LAYOUT, tokens, fingerprint=FP)
        order = [(g, c) for g, keys in enumerate(eager) for c in range(len(keys))]
        rng.shuffle(order)
        for g, c in order[:1500]:  # random order: frontier, checkpoints and scratch all exercised
            assert chain.keys[g][c] == eager[g][c], (g, c)
        # descending, as longest_hit walks
        for g in range(3):
            for c in reversed(range(len(eager[g]))):
                assert chain.key(g, c) == eager[g][c]
        assert [list(k) for k in chain.keys] == eager


def test_grow_by_a_block_per_step_equals_from_scratch():
    tokens = tokens_of(3000, seed=3)
    chain = KeyChain(LAYOUT, tokens[:5], fingerprint=FP, salt="t")
    position = 5
    rng = random.Random(4)
    while position < len(tokens):
        step = rng.choice([1, 7, 8, 64, 300])
        chain = chain.extended(tokens[position : position + step])
        position = min(len(tokens), position + step)
        assert chain.num_tokens == position
        # read the newest key of every group, as a decode step's lookup/store would
        for g, keys in enumerate(chain.keys):
            if len(keys):
                assert keys[len(keys) - 1] == brute_force_key(LAYOUT, tokens, FP, b"t", g, len(keys) - 1)
    assert [list(k) for k in chain.keys] == chunk_keys(LAYOUT, tokens, fingerprint=FP, salt="t")


def test_a_shorter_view_stays_valid_and_forks_when_extended_differently():
    tokens = tokens_of(3000, seed=5)
    short = KeyChain(LAYOUT, tokens[:1500], fingerprint=FP)
    long = short.extended(tokens[1500:])
    assert [list(k) for k in long.keys] == chunk_keys(LAYOUT, tokens, fingerprint=FP)
    other_tail = [t + 1 for t in tokens[1500:]]
    fork = short.extended(other_tail)  # short's stream is already longer: a private copy
    assert [list(k) for k in fork.keys] == chunk_keys(LAYOUT, tokens[:1500] + other_tail, fingerprint=FP)
    assert [list(k) for k in short.keys] == chunk_keys(LAYOUT, tokens[:1500], fingerprint=FP)
    assert [list(k) for k in long.keys] == chunk_keys(LAYOUT, tokens, fingerprint=FP)  # untouched


def test_fork_from_a_view_behind_the_frontier():
    tokens = tokens_of(4000, seed=6)
    full = KeyChain(LAYOUT, tokens, fingerprint=FP)
    assert full.keys[0][-1]  # moves the frontier to the end of the stream
    short = KeyChain(LAYOUT, tokens[:10], fingerprint=FP).extended(tokens[10:2100])
    short.keys[0][-1]
    grown = short.extended(tokens[2100:])
    again = short.extended(tokens[2100:2200])  # fork: short's stream reaches past 2100 tokens
    assert list(again.keys[2]) == chunk_keys(LAYOUT, tokens[:2200], fingerprint=FP)[2]
    assert list(grown.keys[1]) == list(full.keys[1])


def test_numpy_and_torch_tokens_hash_like_lists():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    tokens = tokens_of(700, seed=7)
    expected = chunk_keys(LAYOUT, tokens, fingerprint=FP)
    assert chunk_keys(LAYOUT, np.array(tokens, dtype=np.int64), fingerprint=FP) == expected
    assert chunk_keys(LAYOUT, torch.tensor(tokens, dtype=torch.int32), fingerprint=FP) == expected


def test_sequence_protocol_of_group_keys():
    chain = KeyChain(LAYOUT, tokens_of(600, seed=8), fingerprint=FP)
    keys = chain.keys[2]
    eager = chunk_keys(LAYOUT, tokens_of(600, seed=8), fingerprint=FP)[2]
    assert len(keys) == 75 and keys[-1] == eager[-1] and keys[3:9] == eager[3:9] and keys[::10] == eager[::10]
    assert chain.key(2, 75) is None and chain.key(2, -1) is None
    with pytest.raises(IndexError, match="chunk index 75 out of range for 75 chunks"):
        keys[75]
    with pytest.raises(ValueError, match="non-negative"):
        chain.extended([3, -1])


def test_a_prompt_sharing_nothing_reads_one_state_and_hashes_one_chunk():
    from kvtier.policy import ChunkState, longest_hit

    chain = KeyChain(LAYOUT, tokens_of(16384, seed=9), fingerprint=FP)
    reads = []

    def state(g, c):
        reads.append((g, c))
        assert chain.key(g, c) is not None
        return ChunkState.MISSING

    assert longest_hit(LAYOUT, chain.num_tokens - 1, state) == 0
    assert reads == [(0, 0)]
    assert chain._state.frontier_tokens == 256  # only the first full-attention chunk was hashed


def test_a_pending_first_chunk_still_walks_and_waits():
    from kvtier.policy import ChunkState, longest_hit

    reads = []

    def state(g, c):
        reads.append((g, c))
        return ChunkState.PENDING if (g, c) == (0, 0) else ChunkState.READY

    assert longest_hit(LAYOUT, 4096, state) is None  # the full hit needs chunk 0: ask again
    assert len(reads) == len(set(reads))  # chunk 0 was read once, not again by the walk
