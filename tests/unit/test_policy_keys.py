"""Chunk keys (DESIGN.md, "Keys"): one per complete chunk, chained, bound to fingerprint, salt and
group, stable across processes and hash seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.policy import AttentionGroup, ModelLayout, chunk_keys

LAYOUT = ModelLayout(
    (
        AttentionGroup(block_size=16),  # T = 16
        AttentionGroup(block_size=4, blocks_per_chunk=2, sliding_window=8, extra_retained_tokens=3),  # T = 8
        AttentionGroup(block_size=4, blocks_per_chunk=2, sliding_window=8, extra_retained_tokens=3),  # same spec
    )
)
TOKENS = [(7919 * i + 13) % 50257 for i in range(70)]
FP = b"model=tiny;dtype=bf16;weights=v1"


def keys(tokens=TOKENS, *, layout=LAYOUT, fingerprint=FP, salt=None):
    return chunk_keys(layout, tokens, fingerprint=fingerprint, salt=salt)


def all_keys(result):
    return [k for group in result for k in group]


def test_one_key_per_complete_chunk_per_group():
    result = keys()
    assert [len(group) for group in result] == [70 // 16, 70 // 8, 70 // 8]  # [4, 8, 8]
    for n in (0, 7, 8, 15, 16, 17):
        assert [len(group) for group in keys(TOKENS[:n])] == [n // 16, n // 8, n // 8]


def test_keys_are_short_bytes_and_deterministic():
    result = keys()
    for key in all_keys(result):
        assert isinstance(key, bytes)
        assert 16 <= len(key) <= 64
    assert keys() == result
    assert keys(tuple(TOKENS)) == result
    assert keys(iter(TOKENS)) == result  # any iterable of ints


def test_all_keys_distinct():
    result = keys()
    assert len(set(all_keys(result))) == len(all_keys(result))


def test_groups_with_the_same_spec_get_different_keys():
    result = keys()
    assert LAYOUT.groups[1] == LAYOUT.groups[2]
    assert set(result[1]).isdisjoint(result[2])
    assert set(result[0]).isdisjoint(result[1])


def test_salts_fingerprints_separate_keys():
    base = set(all_keys(keys()))
    tenant_a = set(all_keys(keys(salt=b"tenant-a")))
    tenant_b = set(all_keys(keys(salt=b"tenant-b")))
    empty_salt = set(all_keys(keys(salt=b"")))
    other_model = set(all_keys(keys(fingerprint=b"model=tiny;dtype=bf16;weights=v2")))
    other_model_salted = set(all_keys(keys(fingerprint=b"model=tiny;dtype=bf16;weights=v2", salt=b"tenant-a")))
    families = [base, tenant_a, tenant_b, empty_salt, other_model, other_model_salted]
    for i, one in enumerate(families):
        for other in families[i + 1 :]:
            assert one.isdisjoint(other)
    assert set(all_keys(keys(salt=b"tenant-a"))) == tenant_a  # a salt is deterministic too


def test_fingerprint_is_length_prefixed_not_concatenated():
    # A fingerprint that swallows the first token's bytes must not give the same chain.
    a = keys(fingerprint=b"ab")
    b = keys(fingerprint=b"a")
    assert set(all_keys(a)).isdisjoint(all_keys(b))


def test_equal_prefixes_give_equal_keys():
    other = TOKENS[:40] + [t + 1 for t in TOKENS[40:]]
    mine, theirs = keys(), keys(other)
    # Group 0 (T = 16): chunks 0, 1 lie inside the shared 40 tokens; 2, 3 do not.
    assert mine[0][:2] == theirs[0][:2]
    assert mine[0][2] != theirs[0][2] and mine[0][3] != theirs[0][3]
    # Groups 1, 2 (T = 8): chunks 0..4 shared.
    for g in (1, 2):
        assert mine[g][:5] == theirs[g][:5]
        assert all(mine[g][c] != theirs[g][c] for c in range(5, 8))
    # A prefix alone gives exactly the leading keys of the longer request.
    short = keys(TOKENS[:40])
    assert short == [mine[0][:2], mine[1][:5], mine[2][:5]]


@pytest.mark.parametrize("position", [0, 15, 16, 33, 63])
def test_changed_token_changes_its_chunk_and_every_later_one(position):
    changed = list(TOKENS)
    changed[position] += 1
    mine, theirs = keys(), keys(changed)
    for g, group in enumerate(LAYOUT.groups):
        hit = position // group.tokens_per_chunk
        for c in range(len(mine[g])):
            if c < hit:
                assert mine[g][c] == theirs[g][c], (g, c)
            else:
                assert mine[g][c] != theirs[g][c], (g, c)


def test_chain_binds_order_not_only_content():
    swapped = TOKENS[8:16] + TOKENS[:8] + TOKENS[16:]
    mine, theirs = keys(), keys(swapped)
    assert mine[1][0] != theirs[1][0] and mine[1][1] != theirs[1][1]
    assert mine[1][2] != theirs[1][2]  # same tokens in chunk 2, different prefix


def test_token_width_is_fixed():
    # 256 must not hash like [0, 1] or [1, 0]: tokens are fixed-width, not minimal bytes.
    layout = ModelLayout((AttentionGroup(block_size=2),))
    big = chunk_keys(layout, [256, 0], fingerprint=FP)
    assert big != chunk_keys(layout, [0, 1], fingerprint=FP)
    assert big != chunk_keys(layout, [1, 0], fingerprint=FP)


_CHILD = r"""
import json, sys
from kvtier.policy import AttentionGroup, ModelLayout, chunk_keys
layout = ModelLayout((AttentionGroup(block_size=16),
    AttentionGroup(block_size=4, blocks_per_chunk=2, sliding_window=8, extra_retained_tokens=3),
    AttentionGroup(block_size=4, blocks_per_chunk=2, sliding_window=8, extra_retained_tokens=3)))
tokens = json.loads(sys.argv[1])
out = {}
for name, salt in (("none", None), ("salted", b"tenant-a"), ("str", "tenant-a")):
    out[name] = [[k.hex() for k in g] for g in chunk_keys(layout, tokens, fingerprint=sys.argv[2], salt=salt)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_keys_stable_across_processes_and_hash_seeds(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    fingerprint = FP.decode()
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(TOKENS), fingerprint],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    child = json.loads(completed.stdout)
    here = {
        "none": keys(fingerprint=fingerprint),
        "salted": keys(fingerprint=fingerprint, salt=b"tenant-a"),
        "str": keys(fingerprint=fingerprint, salt="tenant-a"),
    }
    for name, result in here.items():
        assert child[name] == [[k.hex() for k in g] for g in result], name
    # str and bytes fingerprints name the same model
    assert keys(fingerprint=fingerprint) == keys(fingerprint=FP)


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([1, -1, 3], "non-negative, got -1"),
        ([1, 2.5, 3], r"integers in \[0, 2\*\*32\), got 2.5"),
        ([1, "2", 3], "integers"),
        ([1, None], "integers"),
        ([2**32], r"integers in \[0, 2\*\*32\), got 4294967296"),
        (iter([5, -7]), "non-negative, got -7"),
    ],
)
def test_bad_tokens_raise_value_error(tokens, message):
    with pytest.raises(ValueError, match=message):
        keys(tokens)


@pytest.mark.parametrize("fingerprint", [b"", ""])
def test_empty_fingerprint_raises(fingerprint):
    with pytest.raises(ValueError, match="fingerprint must not be empty"):
        keys(fingerprint=fingerprint)


@pytest.mark.parametrize("fingerprint", [None, 42, ["model"]])
def test_non_bytes_fingerprint_raises(fingerprint):
    with pytest.raises(ValueError, match="fingerprint must be bytes or str"):
        keys(fingerprint=fingerprint)


@pytest.mark.parametrize("salt", [42, 1.5, ["tenant"]])
def test_non_bytes_salt_raises(salt):
    with pytest.raises(ValueError, match="salt must be bytes or str"):
        keys(salt=salt)
