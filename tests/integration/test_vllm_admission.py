"""``KvtierTier``'s disk admission under vLLM 0.33's real Scheduler and OffloadingConnector on CPU.

vLLM cascades every chunk it stores into its CPU tier to each secondary tier at once
(``TieringOffloadingManager.complete_store``), so under ``disk_admission = "seen"`` a chunk's
first store is declined and the store after vLLM's CPU tier lost it (and recomputed it) lands.
The rig (``testing.VllmCpuRig``) builds the scheduler and its tiers in ``EngineCore``'s order;
vLLM's own back-pressure detector is configured on the tier, as a server's tier dict does.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

from kvtier.integrations.vllm import VllmTierConfigError
from kvtier.integrations.vllm.testing import VllmCpuRig
from kvtier.tiers.admission import AdmitAll, SeenBefore

from test_vllm_tier import CONSUMER, PROMPT, assert_restored_bitwise, group_specs, make_rig, producer_block_bytes, \
    tier_config

ROW = 4096  # the rig's primary row (two groups' 1 KiB pages, page-aligned); its CPU tier holds 32
BACKPRESSURE = {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.01, "low_water_s": 0.002}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"disk_admission": "tinylfu"}, r"^KvtierTier disk_admission must be one of all, seen, seen-tail, got 'tinylfu'$"),
        ({"disk_admission": None}, r"^KvtierTier disk_admission must be one of all, seen, seen-tail, got None$"),
        ({"eviction_policy": "arc"}, r"^KvtierTier eviction_policy must be one of arc-lfuda, lfuda, lru, got 'arc'$"),
    ],
)
def test_an_unknown_policy_name_is_a_typed_error_listing_the_valid_ones(tmp_path, extra, message):
    with pytest.raises(VllmTierConfigError, match=message):
        make_rig(tmp_path, **extra)


def _spied(tier, positions=None):
    """The offload keys of every store vLLM submits to ``tier`` and every result it hands vLLM
    (and into ``positions``, each key's end token as the job's ReqContext records it)."""
    stores, results = [], []
    submit, finished = tier.submit_store, tier.get_finished_jobs

    def submit_store(job):
        stores.append(list(job.keys))
        if positions is not None:
            positions.update((key, job.req_context.get_offload_key_position(key)) for key in job.keys)
        return submit(job)

    def get_finished_jobs():
        done = list(finished())
        results.extend(done)
        return done

    tier.submit_store, tier.get_finished_jobs = submit_store, get_finished_jobs
    return stores, results


def test_seen_declines_a_first_store_misses_it_and_lands_the_second_exactly(tmp_path):
    """A disk of 16 rows under a CPU tier of 32: ``seen`` holds. The producer's 4 chunks are
    declined: not written, never RETRY nor HIT, reported to vLLM as a successful store of 0 bytes
    (no cascade failure in vLLM's metrics, nothing timed by its back-pressure detector). After
    vLLM's CPU tier is wiped the same prompt is recomputed and stored again: those exact 4 keys land
    in LMDB, and the consumer restores them bitwise from kvtier."""
    rig = VllmCpuRig(group_specs(0), [tier_config(tmp_path / "kv", disk_admission="seen", disk_capacity_bytes=16 * ROW,
                                                  compression=0, backpressure=dict(BACKPRESSURE))],
                     retention=0, model_dir=tmp_path / "model", log_stats=True)
    try:
        tier = rig.secondary_tiers[0]
        assert tier._row_bytes == ROW and len(tier._rows) == 32
        assert isinstance(tier._admission, SeenBefore)
        stores, results = _spied(tier)
        first = rig.run(PROMPT)
        assert dict(first.stored) == {0: {0, 1}, 1: {6, 7}}  # vLLM's GPU -> CPU copies
        assert len(stores) == 1 and len(stores[0]) == 4
        declined = stores[0]
        assert tier.counters["stores_declined"] == 4 and tier.counters["stores_ok"] == 1
        assert tier.statistics()["indexed_chunks"] == 0 and tier.statistics()["records"] == 0
        assert [tier.lookup(key, ReqContext(req_id="probe")) for key in declined] == [LookupResult.MISS] * 4
        assert [(r.success, r.transfer_bytes) for r in results] == [(True, 0)]
        assert tier.bp_detector._completions == 0  # a store of 0 bytes is not timed

        rig.wipe()  # vLLM's CPU tier forgets the prompt: the next run recomputes and stores it again
        again = rig.run(PROMPT)
        assert again.external_hit_tokens == 0
        assert len(stores) == 2 and set(stores[1]) == set(declined)
        assert [(r.success, r.transfer_bytes) for r in results] == [(True, 0), (True, 4 * ROW)]
        assert tier.bp_detector._completions == 1
        landed = set(tier.run_on_loop(tier.disk_tier.list_keys()))
        assert landed == set(tier.layout.chunk_keys(declined)) == tier.store.index.keys()
        assert [tier.lookup(key, ReqContext(req_id="probe")) for key in declined] == [LookupResult.HIT] * 4
        produced = producer_block_bytes(rig, again)

        rig.wipe()
        consumed = rig.run(CONSUMER)
        assert consumed.external_hit_tokens == 32
        assert assert_restored_bitwise(rig, consumed, produced) == 4
        assert tier.tier_hits["disk_hits"] == 4
        total = OffloadingConnectorStats()
        for payload in rig.connector_stats:
            total.aggregate(OffloadingConnectorStats(data=payload))
        _, values = total.metric_sections()
        assert TieringOffloadingMetrics.CASCADE_JOB_FAILURES not in values
    finally:
        rig.shutdown()


def test_seen_tail_declines_only_each_groups_last_chunk_of_a_first_store(tmp_path):
    """``seen-tail`` over a disk larger than vLLM's CPU tier (where ``seen`` writes everything):
    of the producer's one store job, the last chunk of each group (end token 32 of the 33-token
    prompt: FA chunk 1, SWA chunk 7) is declined and misses; the other two land. Recomputed after
    a wipe, the two tails are stored again and land: all four keys are in LMDB."""
    rig = make_rig(tmp_path, disk_admission="seen-tail", disk_capacity_bytes=64 * ROW, compression=0)
    try:
        tier = rig.secondary_tiers[0]
        assert isinstance(tier._admission, SeenBefore)
        positions = {}
        stores, results = _spied(tier, positions)
        rig.run(PROMPT)
        assert len(stores) == 1 and len(stores[0]) == 4
        tails = {key for key, end in positions.items() if end == 32}
        assert len(tails) == 2 and sorted(positions.values()) == [16, 28, 32, 32]
        landed = set(tier.run_on_loop(tier.disk_tier.list_keys()))
        assert landed == set(tier.layout.chunk_keys([k for k in stores[0] if k not in tails]))
        assert tier.counters["stores_declined"] == 2
        assert [tier.lookup(key, ReqContext(req_id="probe")) for key in tails] == [LookupResult.MISS] * 2
        assert [(r.success, r.transfer_bytes) for r in results] == [(True, 2 * ROW)]
        rig.wipe()
        rig.run(PROMPT)
        landed = set(tier.run_on_loop(tier.disk_tier.list_keys()))
        assert landed == set(tier.layout.chunk_keys(stores[0])) == tier.store.index.keys()
        # the first store, the promotion of the two chunks that landed, the store of the two tails
        assert [(r.success, r.transfer_bytes) for r in results] == [(True, 2 * ROW)] * 3
    finally:
        rig.shutdown()


@pytest.mark.parametrize("extra", [{"disk_capacity_bytes": 64 * ROW}, {}], ids=["disk-larger-than-cpu", "unbounded"])
def test_seen_writes_through_where_the_disk_outreaches_vllms_cpu_tier(tmp_path, extra):
    """A disk of more rows than vLLM's CPU tier, or an unbounded one: every chunk is written at its
    first store (the admission's own rule), so the consumer hits after the first run."""
    rig = make_rig(tmp_path, disk_admission="seen", compression=0, **extra)
    try:
        tier = rig.secondary_tiers[0]
        assert isinstance(tier._admission, AdmitAll)
        rig.run(PROMPT)
        assert tier.statistics()["indexed_chunks"] == 4 and tier.counters["stores_declined"] == 0
        rig.wipe()
        assert rig.run(CONSUMER).external_hit_tokens == 32
    finally:
        rig.shutdown()


@pytest.mark.parametrize("policy, expected", [
    ("lru", {"cpu": "lru", "eviction_policy": "lru", "disk_admission": "all"}),
    ("lru+seen", {"cpu": "lru", "eviction_policy": "lru", "disk_admission": "seen"}),
    ("lfuda+seen", {"cpu": "lru", "eviction_policy": "lfuda", "disk_admission": "seen"}),
    ("arc", {"cpu": "arc", "eviction_policy": "lru", "disk_admission": "all"}),
    ("arc-lfuda+seen", {"cpu": "arc", "eviction_policy": "arc-lfuda", "disk_admission": "seen"}),
])
def test_replay_through_vllm_policy_names_set_vllms_cpu_tier_and_the_tier(policy, expected):
    """``kvtier replay --through-vllm --policy NAME``: vLLM's CPU tier takes its own ``lru`` or
    ``arc``; ``KvtierTier`` the disk eviction and admission the engine's disk takes for NAME."""
    from kvtier.tools.replay.vllm_mode import vllm_policies

    assert vllm_policies(policy) == expected
