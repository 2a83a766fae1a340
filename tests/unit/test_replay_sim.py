"""The fast mode against brute-force oracles written here, and the pieces it is built from.

Oracles (full attention, one group, chunks = trace blocks of 4 tokens): a request's hit is its
leading run of cached chunks, capped at its last token (``min(4k, 4 * floor((n - 1) / 4))``); LRU
touches the hit's chunks, then inserts the new complete chunks in order and drops the oldest while
over capacity; Belady drops, while over capacity, the cached chunk whose next request that can hit
it is farthest (one whose last token it does not hold; never: farthest of all; ties: the deepest
chunk, then the smallest id, as the simulator's heap).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tools.replay.command import parse_budget
from kvtier.tools.replay.layouts import ReplayLayout, preset
from kvtier.tools.replay.report import paired_bootstrap, summarize
from kvtier.tools.replay.sim import policy_class, simulate_belady, simulate_engine, simulate_lru, split_policy
from kvtier.tools.replay.trace import Request, Trace
from kvtier.tools.replay.workload import Plans, Workload, host_slots

BLOCK = 4
LAYOUT = ReplayLayout("test", ModelLayout((AttentionGroup(BLOCK),)), (10,), ("full",))


@st.composite
def traces(draw, max_requests: int = 14):
    """Requests that continue an earlier one (a shared prefix of its blocks) or start afresh."""
    count = draw(st.integers(1, max_requests))
    fresh = iter(range(1, 10_000))
    prompts: List[List[int]] = []
    for _ in range(count):
        blocks: List[int] = []
        if prompts and draw(st.booleans()):
            parent = draw(st.sampled_from(prompts))
            blocks = parent[: draw(st.integers(0, len(parent)))]
        blocks = blocks + [next(fresh) for _ in range(draw(st.integers(0 if blocks else 1, 5)))]
        prompts.append(blocks)
    requests = []
    for i, blocks in enumerate(prompts):
        n = len(blocks) * BLOCK - draw(st.integers(0, BLOCK - 1))
        requests.append(Request(i, float(i), n, 0, block_ids=np.asarray(blocks, dtype=np.int64)))
    return Trace("generated", "mooncake", requests, block_tokens=BLOCK)


def _oracle_hit(chunks, n, present) -> int:
    k = 0
    while k < len(chunks) and chunks[k] in present:
        k += 1
    return min(k * BLOCK, (n - 1) // BLOCK * BLOCK)


def _oracle_lru(work: Workload, capacity_chunks: int) -> List[int]:
    cache: "OrderedDict[int, None]" = OrderedDict()
    hits = []
    for r, n in enumerate(work.tokens):
        chunks = [work.ids[r][0][c] for c in range(n // BLOCK)]
        hit = _oracle_hit(chunks, n, cache)
        hits.append(hit)
        for key in chunks[: hit // BLOCK]:
            cache.move_to_end(key)
        for key in chunks:
            if key not in cache:
                cache[key] = None
        while len(cache) > capacity_chunks:
            cache.popitem(last=False)
    return hits


def _oracle_belady(work: Workload, capacity_chunks: int) -> List[int]:
    every = [[work.ids[r][0][c] for c in range(n // BLOCK)] for r, n in enumerate(work.tokens)]
    cache = set()
    depth = {}
    hits = []
    for r, n in enumerate(work.tokens):
        chunks = every[r]
        hit = _oracle_hit(chunks, n, cache)
        hits.append(hit)
        cache.update(chunks)
        depth.update((key, c) for c, key in enumerate(chunks))
        while len(cache) > capacity_chunks:
            def next_use(key):
                return next((later for later in range(r + 1, len(every))
                             if key in every[later][: (work.tokens[later] - 1) // BLOCK]), len(every) + 1)
            victim = max(cache, key=lambda key: (next_use(key), depth[key], -key))
            cache.remove(victim)
    return hits


@settings(max_examples=150, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 12))
def test_reference_lru_and_belady_match_their_brute_force_oracles(trace, capacity):
    work = Workload.prepare(trace, LAYOUT)
    plans = Plans(LAYOUT, None)
    lru = simulate_lru(work, plans, chunk_bytes=[10], capacity=10 * capacity)
    assert lru.hit_tokens.tolist() == _oracle_lru(work, capacity)
    belady = simulate_belady(work, plans, chunk_bytes=[10], capacity=10 * capacity)
    assert belady.hit_tokens.tolist() == _oracle_belady(work, capacity)
    # The bound is a bound on this trace: equal-size chunks in one group, a cache closed under
    # parents, and a use counted only where it can be a hit.
    assert belady.hit_tokens.sum() >= lru.hit_tokens.sum()


@settings(max_examples=100, deadline=None)
@given(trace=traces(), slots=st.integers(12, 30))
def test_the_engine_model_host_alone_is_an_lru_of_its_slots(trace, slots):
    # Host only, every request's chunks fitting half a pool (one load window, no dropped store):
    # the engine's host pool is a plain LRU over chunk counts.
    work = Workload.prepare(trace, LAYOUT)
    model = simulate_engine(work, Plans(LAYOUT, None), host_slots=[slots], chunk_bytes=[10], disk_capacity=None,
                            disk_record_bytes=[10], has_disk=False)
    assert model.hit_tokens.tolist() == _oracle_lru(work, slots)
    assert set(model.tiers) == {"host"} and not model.dropped_stores


def test_the_engine_model_keeps_on_the_host_a_chunk_a_store_finds_there_alone():
    # Host 8 chunks, disk 4 (chunks of one block). B's store evicts A's four chunks from the disk
    # (the host keeps them); X's evicts a1 from the host. A again: its hit stops at a1 (0 tokens);
    # its store takes a1 in and finds a2-a4 on the host alone: uses there, so a1's slot comes from
    # B's oldest chunk and A's next request hits all four. Without the use, a1's slot was a2's:
    # the next hit stopped after a1 (4 tokens).
    prompts = [[1, 2, 3, 4, 10], [5, 6, 7, 8], [9], [1, 2, 3, 4, 10], [1, 2, 3, 4, 10]]
    lengths = [17, 16, 4, 17, 17]
    trace = Trace("t", "mooncake", [Request(i, float(i), n, 0, block_ids=np.asarray(b, dtype=np.int64))
                                    for i, (b, n) in enumerate(zip(prompts, lengths))], block_tokens=BLOCK)
    work = Workload.prepare(trace, LAYOUT)
    model = simulate_engine(work, Plans(LAYOUT, None), host_slots=[8], chunk_bytes=[10], disk_capacity=40,
                            disk_record_bytes=[10])
    assert model.hit_tokens.tolist() == [0, 0, 0, 0, 16]
    assert model.tiers["host"].evicted_chunks == 2 and model.tiers["disk"].evicted_chunks == 6


def test_unique_chunks_count_each_chunk_once():
    blocks = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    trace = Trace("t", "mooncake", [Request(i, 0.0, len(b) * BLOCK - (1 if i == 1 else 0), 0,
                                            block_ids=np.asarray(b)) for i, b in enumerate(blocks)], block_tokens=BLOCK)
    work = Workload.prepare(trace, LAYOUT)
    # chains 1, 1-2, 1-2-3 complete; 1-2-4 is partial in request 1 (11 tokens): not a chunk.
    assert work.unique_chunks == work.all_chunks == [3]
    assert work.ids[0][0].take([0, 1, 2]) == work.ids[2][0].take([0, 1, 2])
    assert work.ids[1][0].take([0, 1]) == work.ids[0][0].take([0, 1])
    two = ReplayLayout("two", ModelLayout((AttentionGroup(BLOCK), AttentionGroup(2, sliding_window=2))), (10, 3), ("f", "s"))
    both = Workload.prepare(trace, two)
    # 2-token chunks: two per complete block, and one in the 3 tokens request 1 has of block 1-2-4.
    assert both.all_chunks == [3, 7]
    # A dense store keeps, per 4-token boundary, the window's last token: the second chunk of each
    # block, and at the final block boundary of request 1 (10 tokens) the chunk of tokens 8-9.
    assert both.unique_chunks == [3, 4]
    assert len(set(both.ids[0][1].take(range(6))) | set(both.ids[0][0].take(range(3)))) == 9  # groups never collide


def test_host_slots_are_those_of_the_real_pools():
    from kvtier.tiers.host import host_split_weights, pools_for_budget

    cases = ((1 << 20, "gpt-oss-120b", None), (50 << 20, "deepseek-v4", None), (50 << 20, "deepseek-v4", 0),
             (10, "full-attention", None), (8 << 20, "gemma-3-27b", 1024))
    for capacity, name, retention in cases:
        layout = preset(name, 3)
        chunks = [max(1, size // 1000) for size in layout.all_chunk_bytes]
        plans = Plans(layout, retention)
        pools = pools_for_budget(capacity, chunks, weights=host_split_weights(layout.layout, chunks, retention))
        try:
            assert host_slots(capacity, chunks, plans) == [p.num_slots for p in pools]
        finally:
            for pool in pools:
                pool.close()


def test_budgets_parse_as_bytes_shares_or_unbounded():
    assert parse_budget("4GiB", "--host-bytes") == (4 << 30, None)
    assert parse_budget("5%", "--disk-bytes") == (None, 0.05)
    assert parse_budget("unbounded", "--disk-bytes") == (None, None)
    assert parse_budget("0", "--disk-bytes") == (0, None)
    for bad, message in (("150%", r"a share must be in \(0%, 100%\]"), ("-1GiB", "must be a size >= 0"), ("x%", "share")):
        with pytest.raises(ValueError, match=message):
            parse_budget(bad, "--disk-bytes")


def test_an_unknown_policy_lists_the_valid_ones():
    assert policy_class("lfuda")(4).policy.name == "lfuda"
    with pytest.raises(ValueError, match=r"--policy 'fifo' is unknown; valid: arc, arc-lfuda, lfuda, lru, "
                                         r"arc\+seen, arc-lfuda\+seen, lfuda\+seen, lru\+seen$"):
        policy_class("fifo")
    assert split_policy("lru+seen") == ("lru", "seen") and split_policy("arc") == ("arc", "all")
    assert policy_class("lru+seen")(4).policy.name == "lru"


def test_an_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"not a preset; valid: deepseek-v4, full-attention, gemma-3-27b, gpt-oss-120b"):
        preset("llama")


def test_presets_carry_the_models_true_bytes_per_token():
    gpt = preset("gpt-oss-120b", 3)
    assert [gpt.bytes_per_token(g) for g in range(2)] == [18 * 2 * 8 * 64 * 2] * 2
    assert gpt.layout.groups[1].sliding_window == 128 and gpt.layout.groups[1].extra_retained_tokens == 3
    assert gpt.layout.groups[0].tokens_per_chunk == 512
    gemma = preset("gemma-3-27b")
    assert gemma.bytes_per_token(0) == 10 * 8192 and gemma.bytes_per_token(1) == 52 * 8192
    dsv4 = preset("deepseek-v4", 1)
    assert dsv4.layout.alignment_tokens == 512 and dsv4.layout.hit_granularity_tokens == 128
    assert dsv4.bytes_per_token(0) == 43 * 512 * 2  # K=V once, bf16
    assert dsv4.bytes_per_token(1) == 20 * 640 * 4 / 4  # one fp32 entry per 4 tokens
    assert preset("full-attention").chunk_bytes(0) == 512 * 128 * 1024
    scaled = gpt.scaled(1 / 1024)
    assert scaled.block_bytes == (576, 576) and scaled.scale == 1 / 1024
    with pytest.raises(ValueError, match="bytes-scale"):
        gpt.scaled(2)


def test_the_deepseek_preset_matches_the_cache_plan_of_transformers_config():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from kvtier.integrations.transformers import DeepseekV4CachePlan

    plan = DeepseekV4CachePlan(transformers.DeepseekV4Config(), block_size=64, blocks_per_chunk=4)
    ours = preset("deepseek-v4")
    assert ours.layout == plan.layout
    for g, row in enumerate(plan.store_bytes(100_000, torch.bfloat16)):
        every = 100_000 // ours.layout.groups[g].tokens_per_chunk
        assert row["every"] == every * ours.chunk_bytes(g), row


def test_paired_bootstrap_interval():
    tokens = np.full(200, 100)
    same = np.arange(200) % 50
    assert paired_bootstrap(same, same, tokens, samples=200) == (0.0, 0.0, 0.0)
    more = same + 10
    delta, low, high = paired_bootstrap(more, same, tokens, samples=200)
    assert delta == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    noisy = same + (np.arange(200) % 3 == 0) * 30
    delta, low, high = paired_bootstrap(noisy, same, tokens, samples=500)
    assert low < delta < high and delta == pytest.approx(30 * 67 / 20000)


def test_summary_splits_hits_by_the_bytes_each_tier_served():
    work = Workload.prepare(Trace("t", "mooncake", [
        Request(i, 0.0, 4 * BLOCK, 0, block_ids=np.asarray([1, 2, 3, 4])) for i in range(10)], block_tokens=BLOCK), LAYOUT)
    outcome = simulate_engine(work, Plans(LAYOUT, None), host_slots=[4], chunk_bytes=[10], disk_capacity=None,
                              disk_record_bytes=[10])
    summary = summarize(outcome, warmup_fraction=0.1)
    assert summary["hit_rate"] == pytest.approx(9 * 12 / 160)
    assert summary["hit_rate_by_tier"]["host"] + summary["hit_rate_by_tier"]["disk"] == pytest.approx(summary["hit_rate"])
    assert summary["hit_rate_after_warmup"] == pytest.approx(12 / 16) and summary["warmup_requests"] == 1
    assert summary["tiers"]["disk"]["stored_chunks"] == 4


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(0, 3000), extra=st.sampled_from([0, 1, 3]), retention=st.sampled_from([None, 0, 512, 1024]),
       name=st.sampled_from(["gpt-oss-120b", "gemma-3-27b", "deepseek-v4", "full-attention"]))
def test_store_plans_are_the_policys(num_tokens, extra, retention, name):
    from kvtier.policy.retention import retention_store_chunk_indices

    layout = preset(name, extra)
    plans = Plans(layout, retention)
    for g in range(len(layout.layout.groups)):
        assert list(plans.store(g, num_tokens)) == retention_store_chunk_indices(layout.layout, g, num_tokens, retention)
