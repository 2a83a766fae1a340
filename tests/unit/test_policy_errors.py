"""Bad input to the policy's dataclasses, their immutability, and the policy's public surface."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import kvtier.policy
from kvtier.policy import (
    AttentionGroup,
    ChunkState,
    ModelLayout,
    longest_hit,
    reachable_store_block_mask,
    retained_interval,
    store_spec,
)

SWA = dict(block_size=4, sliding_window=8)


# --- AttentionGroup ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=0), r"block_size must be positive, got 0"),
        (dict(block_size=-16), r"block_size must be positive, got -16"),
        (dict(block_size=16, blocks_per_chunk=0), r"blocks_per_chunk must be positive, got 0"),
        (dict(block_size=16, blocks_per_chunk=-2), r"blocks_per_chunk must be positive, got -2"),
        (dict(block_size=16, sliding_window=0), r"sliding_window must be positive, got 0"),
        (dict(block_size=16, sliding_window=-128), r"sliding_window must be positive, got -128"),
        (dict(SWA, extra_retained_tokens=-1), r"extra_retained_tokens must be >= 0, got -1"),
        (
            dict(block_size=16, extra_retained_tokens=3),
            r"extra_retained_tokens must be 0 for a full-attention group \(sliding_window=None\), got 3",
        ),
        (dict(block_size=16.0), r"block_size must be an int, got 16\.0"),
        (dict(block_size=True), r"block_size must be an int, got True"),
        (dict(block_size="16"), r"block_size must be an int, got '16'"),
        (dict(block_size=16, blocks_per_chunk=None), r"blocks_per_chunk must be an int, got None"),
        (dict(block_size=16, sliding_window=8.5), r"sliding_window must be an int, got 8\.5"),
        (dict(SWA, extra_retained_tokens=1.0), r"extra_retained_tokens must be an int, got 1\.0"),
        (dict(block_size=16, is_eagle=1), r"is_eagle must be a bool, got 1"),
    ],
)
def test_attention_group_rejects(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        AttentionGroup(**kwargs)


def test_attention_group_accepts_the_smallest_valid_values():
    group = AttentionGroup(block_size=1, blocks_per_chunk=1, sliding_window=1, extra_retained_tokens=0)
    assert group.tokens_per_chunk == 1
    assert AttentionGroup(block_size=16, sliding_window=None, extra_retained_tokens=0).sliding_window is None


# --- ModelLayout ---------------------------------------------------------------------------------


GROUP = AttentionGroup(block_size=16)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (((),), {}, r"^groups must not be empty, got \(\)$"),
        (([],), {}, r"^groups must not be empty, got \(\)$"),
        ((GROUP,), {}, r"^groups must be a sequence of AttentionGroup, got AttentionGroup\("),
        (("ab",), {}, r"^groups must be a sequence of AttentionGroup, got 'ab'$"),
        ((None,), {}, r"^groups must be a sequence of AttentionGroup, got None$"),
        (((GROUP, 16),), {}, r"^groups\[1\] must be an AttentionGroup, got 16$"),
        (((GROUP,),), dict(alignment_tokens=0), r"^alignment_tokens must be positive, got 0$"),
        (((GROUP,),), dict(alignment_tokens=-256), r"^alignment_tokens must be positive, got -256$"),
        (((GROUP,),), dict(alignment_tokens=16.0), r"^alignment_tokens must be an int, got 16\.0$"),
        (((GROUP,),), dict(hit_granularity_tokens=0), r"^hit_granularity_tokens must be positive, got 0$"),
        (((GROUP,),), dict(hit_granularity_tokens="4"), r"^hit_granularity_tokens must be an int, got '4'$"),
    ],
)
def test_model_layout_rejects(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelLayout(*args, **kwargs)


def test_model_layout_derives_and_keeps_its_granularities():
    fa = AttentionGroup(block_size=16, blocks_per_chunk=2)
    swa = AttentionGroup(block_size=4, blocks_per_chunk=16, sliding_window=8)  # T = 64 > 32
    layout = ModelLayout([fa, swa])  # a list is accepted and frozen into a tuple
    assert layout.groups == (fa, swa)
    assert layout.alignment_tokens == 32  # the FA chunk size, though an SWA chunk is larger
    assert layout.hit_granularity_tokens == 4
    assert ModelLayout((swa, AttentionGroup(block_size=8, sliding_window=8))).alignment_tokens == 64
    # Two FA chunk sizes: no single one, so the largest chunk size.
    two_fa = ModelLayout((fa, AttentionGroup(block_size=8), swa))
    assert two_fa.alignment_tokens == 64
    explicit = ModelLayout((fa, swa), alignment_tokens=128, hit_granularity_tokens=8)
    assert (explicit.alignment_tokens, explicit.hit_granularity_tokens) == (128, 8)


# --- functions reject bad arguments --------------------------------------------------------------


def test_functions_reject_bad_arguments():
    layout = ModelLayout((AttentionGroup(**SWA),))
    with pytest.raises(ValueError, match=r"^boundary_tokens must be a non-negative int, got -1$"):
        retained_interval(layout.groups[0], -1)
    with pytest.raises(ValueError, match=r"^max_tokens must be a non-negative int, got -4$"):
        longest_hit(layout, -4, lambda g, c: ChunkState.READY)
    with pytest.raises(ValueError, match=r"^max_tokens must be a non-negative int, got 4\.0$"):
        longest_hit(layout, 4.0, lambda g, c: ChunkState.READY)
    with pytest.raises(ValueError, match=r"^group_index must be in \[0, 1\), got 1$"):
        reachable_store_block_mask(layout, 1, 32)
    with pytest.raises(ValueError, match=r"^num_tokens must be a non-negative int, got -32$"):
        reachable_store_block_mask(layout, 0, -32)


# --- frozen groups, derived specs ----------------------------------------------------------------


def test_attention_group_is_frozen():
    group = AttentionGroup(block_size=4, sliding_window=8, extra_retained_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.sliding_window = 11
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.extra_retained_tokens = 0
    layout = ModelLayout((group,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.alignment_tokens = 8
    assert (group.sliding_window, group.extra_retained_tokens) == (8, 3)


def test_store_spec_is_a_new_object_and_the_group_is_untouched():
    group = AttentionGroup(block_size=4, sliding_window=8, extra_retained_tokens=3, is_eagle=True)
    before = dataclasses.astuple(group)
    spec = store_spec(group)
    assert spec is not group
    assert (spec.block_size, spec.blocks_per_chunk, spec.sliding_window, spec.extra_retained_tokens, spec.is_eagle) == (
        4,
        1,
        11,
        0,
        True,
    )
    assert dataclasses.astuple(group) == before
    # Without extra tokens, or for full attention, there is nothing to widen.
    assert store_spec(AttentionGroup(**SWA)) == AttentionGroup(**SWA)
    assert store_spec(AttentionGroup(block_size=16)) == AttentionGroup(block_size=16)


def test_store_mask_never_mutates_the_layout():
    fa = AttentionGroup(block_size=16)
    swa = AttentionGroup(block_size=4, sliding_window=8, extra_retained_tokens=3)
    layout = ModelLayout((fa, swa))
    before = (dataclasses.astuple(fa), dataclasses.astuple(swa), layout.alignment_tokens)
    reachable_store_block_mask(layout, 1, 33)
    reachable_store_block_mask(layout, 0, 33)
    assert layout.groups[0] is fa and layout.groups[1] is swa
    assert (dataclasses.astuple(fa), dataclasses.astuple(swa), layout.alignment_tokens) == before
    # The real spec (not the widened one) still answers the attention window.
    assert retained_interval(swa, 32) == (22, 32)


# --- public surface ------------------------------------------------------------------------------


def test_public_names_import():
    from kvtier.policy import (  # noqa: F401
        AttentionGroup,
        ChunkState,
        ModelLayout,
        chunk_keys,
        load_window_size_in_chunks,
        longest_hit,
        num_skipped_tokens,
        reachable_store_block_mask,
        retained_interval,
        sliding_window_size_in_chunks,
    )

    assert {state.name for state in ChunkState} == {"MISSING", "PENDING", "READY", "LOADING"}


def test_every_name_in_all_exists_once():
    names = kvtier.policy.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(kvtier.policy, name), name
    for name in (
        "AttentionGroup",
        "ModelLayout",
        "ChunkState",
        "retained_interval",
        "num_skipped_tokens",
        "sliding_window_size_in_chunks",
        "load_window_size_in_chunks",
        "reachable_store_block_mask",
        "longest_hit",
        "chunk_keys",
    ):
        assert name in names, name


def test_policy_import_is_pure():
    """Importing kvtier.policy pulls in no torch, no asyncio and no other kvtier layer."""
    code = (
        "import sys, kvtier.policy; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'asyncio', 'lmdb', 'aiofiles') "
        "or m.startswith(('kvtier.engine', 'kvtier.tiers', 'kvtier.tools'))); "
        "print(','.join(bad))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert completed.stdout.strip() == ""
