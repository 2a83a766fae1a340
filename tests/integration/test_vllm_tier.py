"""kvtier as vLLM 0.33's secondary tier, under vLLM's real Scheduler and OffloadingConnector on CPU.

Only vLLM's GPU <-> CPU copy worker is replaced (``kvtier.integrations.vllm.testing``). The layout
is DESIGN's "alignment skip" example: FA b=16; SWA b=4, W=8, p=1; a 33-token prompt; a consumer
of the same prompt + 1 token. vLLM is installed by README's install command, so a missing vLLM
fails these tests (no skip).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import struct
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvtier.errors import CorruptCacheError
from kvtier.integrations.vllm import KvtierTier, VllmTierConfigError
from kvtier.integrations.vllm.testing import VllmCpuRig
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.policy.plan import load_block_plan
from kvtier.policy.retention import retention_store_chunk_indices
from kvtier.tools.testing.faults import FaultyTier, corrupt_stored_record, inject_io_faults, remove_io_faults

PROMPT = [(i * 7) % 900 + 3 for i in range(33)]
CONSUMER = PROMPT + [5]

# (R, retention) -> (stored SWA blocks, loaded SWA blocks); FA stores and loads {0, 1} throughout.
# These are the sets vLLM 0.33 itself chose (recorded by the copy worker), checked against
# kvtier's policy in test_agreement.
EXPECTED_SWA = {
    (0, 0): ({6, 7}, {6, 7}),
    (1, 0): ({6, 7}, {6, 7}),
    (3, 0): ({5, 6, 7}, {5, 6, 7}),
    (0, None): ({2, 3, 6, 7}, {6, 7}),
    (1, None): ({2, 3, 6, 7}, {6, 7}),
    (3, None): ({1, 2, 3, 5, 6, 7}, {5, 6, 7}),
    (0, 32): ({6, 7}, {6, 7}),
    (1, 32): ({6, 7}, {6, 7}),
    (3, 32): ({5, 6, 7}, {5, 6, 7}),
}


def group_specs(r: int):
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=64, dtype=torch.bfloat16,
                            sliding_window=8, extra_retained_tokens=r)
    return [fa, swa]


def tier_config(cache_dir, **extra):
    return {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "cache_dir": str(cache_dir), **extra}


def make_rig(tmp_path, r=0, retention=0, **extra) -> VllmCpuRig:
    return VllmCpuRig(group_specs(r), [tier_config(tmp_path / "kv", **extra)], retention=retention,
                      model_dir=tmp_path / "model")


def kvtier_layout(r: int) -> ModelLayout:
    return ModelLayout(groups=(AttentionGroup(block_size=16),
                               AttentionGroup(block_size=4, sliding_window=8, extra_retained_tokens=r)))


def assert_restored_bitwise(rig, record, producer_bytes):
    checked = 0
    for group, blocks in record.loaded.items():
        for logical in blocks:
            got = rig.block_bytes(group, record.block_ids[group][logical])
            assert got == producer_bytes[(group, logical)], (group, logical)
            assert got == rig.expected_block(PROMPT, group, logical), (group, logical)
            checked += 1
    return checked


def producer_block_bytes(rig, record):
    return {(g, b): rig.block_bytes(g, record.block_ids[g][b]) for g, blocks in record.stored.items() for b in blocks}


@pytest.mark.parametrize("retention", [0, None, 32], ids=["retention0", "retentionNone", "retention32"])
@pytest.mark.parametrize("r", [0, 1, 3])
def test_bytes_through_vllm(tmp_path, r, retention):
    """Producer prefill cascades to kvtier; vLLM's CPU tier and every GPU byte are wiped; the
    consumer hits from kvtier and every restored block is bitwise the producer's. The (group,
    block) sets vLLM stores and loads equal kvtier's retention_store_chunk_indices and
    load_block_plan for the same layout and retention interval (the Agreement check)."""
    rig = make_rig(tmp_path, r, retention)
    try:
        tier = rig.secondary_tiers[0]
        assert isinstance(tier, KvtierTier)
        produced = rig.run(PROMPT)
        stored_swa, loaded_swa = EXPECTED_SWA[(r, retention)]
        assert dict(produced.stored) == {0: {0, 1}, 1: stored_swa}
        for g in (0, 1):  # agreement: kvtier's own store policy under the same retention interval
            assert produced.stored[g] == set(retention_store_chunk_indices(kvtier_layout(r), g, 33, retention))
        before = producer_block_bytes(rig, produced)
        assert tier.statistics()["records"] == 2 + len(stored_swa)
        rig.wipe()
        consumed = rig.run(CONSUMER)
        assert consumed.external_hit_tokens == 32
        assert dict(consumed.loaded) == {0: {0, 1}, 1: loaded_swa}
        for g in (0, 1):  # agreement: kvtier's load plan for the same hit
            plan = load_block_plan(kvtier_layout(r), g, consumed.external_hit_tokens)
            assert consumed.loaded[g] == {b for _, blocks in plan for b in blocks if b is not None}
        assert assert_restored_bitwise(rig, consumed, before) == 2 + len(loaded_swa)
        assert tier.counters["loads_ok"] >= 1 and tier.counters["promotions_failed"] == 0
        assert tier.tier_hits["disk_hits"] == 2 + len(loaded_swa) and tier.tier_hits["remote_hits"] == 0
        assert tier.tier_hits["disk_hit_tokens"] == 2 * 16 + 4 * len(loaded_swa)
    finally:
        rig.shutdown()


# The tier's records where the defaults put them (these chunks are small: inside LMDB), and every one
# in a segment file (the tier config's lmdb_segment_threshold_bytes and compaction fraction reach
# the LMDB tier).
STORES = {"default": {}, "segments": {"lmdb_segment_threshold_bytes": 1, "lmdb_segment_compaction_live_fraction": 0.25}}


def assert_records_where(tier, store: str) -> None:
    places = {info.segment is not None for info in tier.disk_tier.iter_records()}
    assert places == {store == "segments"}, places
    assert tier.disk_tier._compactor.live_fraction == (0.25 if store == "segments" else 0.5)


@pytest.mark.parametrize("store", sorted(STORES))
def test_restart_hits_from_disk_alone(tmp_path, store):
    """A new scheduler + connector + tier over the same cache directory restores bitwise."""
    rig = make_rig(tmp_path, 3, None, **STORES[store])
    try:
        produced = rig.run(PROMPT)
        before = producer_block_bytes(rig, produced)
        assert_records_where(rig.secondary_tiers[0], store)
    finally:
        rig.shutdown()
    fresh = make_rig(tmp_path, 3, None, **STORES[store])
    try:
        tier = fresh.secondary_tiers[0]
        assert tier.statistics()["indexed_chunks"] == 8  # listed from LMDB at start
        consumed = fresh.run(CONSUMER)
        assert consumed.external_hit_tokens == 32
        assert dict(consumed.loaded) == {0: {0, 1}, 1: {5, 6, 7}}
        assert assert_restored_bitwise(fresh, consumed, before) == 5
    finally:
        fresh.shutdown()


@pytest.mark.parametrize("store", sorted(STORES))
def test_corrupt_record_is_a_failed_promotion_then_recomputed(tmp_path, store):
    """A record corrupted on disk: the load reports the key failed, vLLM recomputes, no wrong
    byte is reported loaded, and the engine keeps serving (the next producer stores again)."""
    rig = make_rig(tmp_path, **STORES[store])
    try:
        tier = rig.secondary_tiers[0]
        rig.run(PROMPT)
        assert_records_where(tier, store)
        for key in list(tier._index):
            corrupt_stored_record(tier.disk_tier, key)
        rig.wipe()
        consumed = rig.run(CONSUMER)
        assert consumed.external_hit_tokens == 0
        assert tier.counters["promotions_failed"] >= 1
        assert tier.statistics()["corrupt"] >= 1
        assert tier.statistics()["indexed_chunks"] == 4  # re-stored by the consumer's own prefill
        assert_recomputed_bytes_right(rig, consumed)
    finally:
        rig.shutdown()


def assert_recomputed_bytes_right(rig, record):
    """Every block the request holds carries the stand-in model's bytes for its prefix: nothing
    from a failed load survived in a block vLLM used."""
    for group, blocks in enumerate(record.block_ids):
        b = rig.group_specs[group].block_size
        for logical, block in enumerate(blocks):
            if block and (logical + 1) * b <= len(CONSUMER):
                assert rig.block_bytes(group, block) == rig.expected_block(CONSUMER, group, logical), (group, logical)


def test_io_error_on_store_and_disk_full_keep_serving(tmp_path):
    """LMDB I/O error at commit, then a disk too small for the records: stores fail (vLLM keeps
    its CPU copy), nothing is indexed, lookups miss, and requests are still served."""
    rig = make_rig(tmp_path)
    try:
        tier = rig.secondary_tiers[0]
        inject_io_faults(tier.disk_tier, fail_from=1, ops=("commit",))
        record = rig.run(PROMPT)
        assert dict(record.stored) == {0: {0, 1}, 1: {6, 7}}  # GPU -> CPU copies happened
        assert tier.counters["store_failures"] >= 1 and tier.statistics()["indexed_chunks"] == 0
        remove_io_faults(tier.disk_tier)
        rig.wipe()
        consumed = rig.run(CONSUMER)
        assert consumed.external_hit_tokens == 0  # nothing durable: recomputed, never a wrong hit
        assert tier.statistics()["indexed_chunks"] == 4  # healed: the consumer's stores landed
        # an I/O error on the read path: the promotion fails, vLLM recomputes, bytes stay right
        inject_io_faults(tier.disk_tier, fail_from=1, ops=("read",))
        rig.wipe()
        again = rig.run(CONSUMER)
        assert again.external_hit_tokens == 0 and tier.counters["promotions_failed"] >= 1
        assert_recomputed_bytes_right(rig, again)
        remove_io_faults(tier.disk_tier)
    finally:
        rig.shutdown()
    full = VllmCpuRig(group_specs(0), [tier_config(tmp_path / "kv-full", disk_capacity_bytes=64, compression=0)],
                      retention=0, model_dir=tmp_path / "model")
    try:
        full.run(PROMPT)
        assert full.secondary_tiers[0].statistics()["records"] == 0
        full.wipe()
        assert full.run(CONSUMER).external_hit_tokens == 0
    finally:
        full.shutdown()


def test_the_tier_opens_its_store_with_the_engines_store_settings(tmp_path):
    """The settings the running tier opened its store with are the engine's for the same
    directory (README: the safety switches are on by default, under vLLM as in the engine), and
    its index is the store's ordered one."""
    from kvtier.engine.config import EngineConfig

    rig = make_rig(tmp_path)
    try:
        tier = rig.secondary_tiers[0]
        engine = EngineConfig(cache_dir=str(tmp_path / "kv"), remote_namespace="vllm").store
        assert tier.store.config == engine
        assert tier.store.config.lmdb_verify_on_open and tier.store.config.quarantine_corrupt_cache_dir
        assert tier.chunk_tier is tier.store.tier and tier.disk_tier is tier.store.local_tier
        rig.run(PROMPT)
        assert tier.store.index.keys() == set(tier.run_on_loop(tier.disk_tier.list_keys()))
        assert tier.run_on_loop(tier.store.problems()) == []
    finally:
        rig.shutdown()


STEP_BOUND_S = 0.5


def test_slow_tier_never_blocks_a_scheduler_step(tmp_path):
    """Every tier call sleeps 2 s: no scheduler step takes longer than STEP_BOUND_S (the tier
    only posts work), lookups answer RETRY while the store is in flight, and the bytes arrive."""
    rig = make_rig(tmp_path)
    try:
        tier = rig.secondary_tiers[0]
        slow = FaultyTier(tier.chunk_tier, delay_s=2.0)
        tier.chunk_tier = slow
        req = rig.add_request(PROMPT)
        worst = max(rig.step() for _ in range(4))
        assert worst < STEP_BOUND_S
        assert tier.has_pending_work()
        in_flight = [k for job in tier._jobs.values() for k in job.keys]
        assert tier.lookup(in_flight[0], ReqContext(req_id="probe")) is LookupResult.RETRY
        tier.drain_jobs()
        while rig._transfers_pending():
            rig.step()
        assert tier.statistics()["indexed_chunks"] == 4
        assert rig.records[req].max_step_s < STEP_BOUND_S
    finally:
        rig.shutdown()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"cache_dirr": "x"}, "unknown config key"),
        ({"compression": 23}, "compression must be an int in 0..22"),
        ({"disk_capacity_bytes": -1}, "disk_capacity_bytes must be a positive int"),
        ({"remote_url": "localhost"}, "remote_url must be a redis://"),
        ({"lmdb_segment_threshold_bytes": -1}, r"^KvtierTier lmdb_segment_threshold_bytes must be an int >= 0 or null "
                                                r"\(null or 0: every record inside LMDB\), got -1$"),
        ({"lmdb_segment_compaction_live_fraction": 1}, r"^KvtierTier lmdb_segment_compaction_live_fraction must be a "
                                                       r"number in \[0, 1\), got 1$"),
        ({"lmdb_verify_on_open": 1}, r"^KvtierTier lmdb_verify_on_open must be a bool, got 1$"),
        ({"quarantine_corrupt_cache_dir": "yes"}, r"^KvtierTier quarantine_corrupt_cache_dir must be a bool, got 'yes'$"),
        ({"eviction_policy": "arc"}, r"^KvtierTier eviction_policy must be one of arc-lfuda, lfuda, lru, got 'arc'$"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, extra, message):
    with pytest.raises(VllmTierConfigError, match=message):
        make_rig(tmp_path, **extra)


def test_offline_warmup_then_a_fresh_scheduler_hits_bitwise(tmp_path, capsys):
    """Warm a cache offline through vLLM's own path (a separate scheduler), check it with
    `kvtier warmup --key-scheme vllm`, then the first request of a fresh scheduler hits bitwise.
    The keys computed offline (vLLM's hasher, cache_salt) are the keys the server hands the tier."""
    from kvtier.integrations.vllm.warmup import load_layout, vllm_chunk_keys, warm_through_vllm
    from kvtier.tools.cli import main

    warmer = make_rig(tmp_path, 0, None)
    try:
        assert warm_through_vllm(warmer, [PROMPT]) == 6
    finally:
        warmer.shutdown()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": PROMPT}) + "\n" + json.dumps({"token_ids": [9] * 33}) + "\n")
    assert main(["warmup", "--key-scheme", "vllm", "--prompts", str(prompts), "--cache-dir", str(tmp_path / "kv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "prompt 1: group 0: 2/2 chunks (2 leading), group 1: 4/8 chunks (0 leading)",
        "prompt 2: group 0: 0/2 chunks (0 leading), group 1: 0/8 chunks (0 leading)",
    ]
    layout = load_layout(tmp_path / "kv")
    server = make_rig(tmp_path, 0, None)
    try:
        tier = server.secondary_tiers[0]
        keys = vllm_chunk_keys(PROMPT, layout)
        indexed = {(k.group_id, k.chunk_index) for k in keys if tier.index_contains(k.offload_key)}
        assert tier.layout == layout  # the server's layout (bound at its first key) is the warmup's
        assert indexed == {(0, 0), (0, 1), (1, 2), (1, 3), (1, 6), (1, 7)}
        salted = vllm_chunk_keys(PROMPT, layout, cache_salt="tenant-b")
        assert not any(tier.index_contains(k.offload_key) for k in salted)
        consumed = server.run(CONSUMER)  # the fresh scheduler's first request
        assert consumed.external_hit_tokens == 32
        assert dict(consumed.loaded) == {0: {0, 1}, 1: {6, 7}}
        for group, blocks in consumed.loaded.items():
            for logical in blocks:
                assert server.block_bytes(group, consumed.block_ids[group][logical]) == server.expected_block(PROMPT, group, logical)
        assert server.run(PROMPT + [7], cache_salt="tenant-b").external_hit_tokens == 0  # salt: other keys
    finally:
        server.shutdown()


def test_xxhash_without_pythonhashseed_warns_once_that_keys_die_with_the_process(tmp_path, monkeypatch, caplog):
    import kvtier.integrations.vllm.tier as tier_module

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(tier_module, "_warned_ephemeral_keys", False)
    caplog.set_level("WARNING", logger="kvtier.integrations.vllm")
    rigs = [VllmCpuRig(group_specs(0), [tier_config(tmp_path / f"kv{i}")], model_dir=tmp_path / "model",
                       hash_algorithm="xxhash") for i in range(2)]
    try:
        for rig in rigs:  # the key scheme (and the warning) binds at the tier's first lookup
            rig.run(PROMPT)
        warnings = [r.getMessage() for r in caplog.records if "PYTHONHASHSEED is not set" in r.getMessage()]
        assert len(warnings) == 1 and "hashes prefix blocks with xxhash" in warnings[0]
        assert "can never be hit after a restart" in warnings[0]
        assert rigs[0].secondary_tiers[0].layout.hash_algorithm == "xxhash"
    finally:
        for rig in rigs:
            rig.shutdown()


def test_fleet_host_b_hits_what_host_a_prefilled_through_the_remote_tier(tmp_path, valkey_node):
    """Two vLLM servers, each with its own LMDB, sharing one real Valkey (remote_url): host B's
    first request restores host A's prefix bitwise from the remote, and promotes it into its LMDB.
    The hit is counted per kvtier tier in the tier's statistics and in the KV connector stats
    vLLM's scheduler hands its Prometheus logger."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    namespace = f"fleet-{os.getpid()}"
    host_a = VllmCpuRig(group_specs(3), [tier_config(tmp_path / "a", remote_url=valkey_node.url, remote_namespace=namespace)],
                        retention=None, model_dir=tmp_path / "model")
    try:
        produced = host_a.run(PROMPT)
        before = producer_block_bytes(host_a, produced)
    finally:
        host_a.shutdown()  # closes the chain: write-behind to the remote has landed
    host_b = VllmCpuRig(group_specs(3), [tier_config(tmp_path / "b", remote_url=valkey_node.url, remote_namespace=namespace)],
                        retention=None, model_dir=tmp_path / "model", log_stats=True)
    try:
        tier = host_b.secondary_tiers[0]
        assert tier.disk_tier.statistics().records == 0  # nothing local: every hit comes from the remote
        consumed = host_b.run(CONSUMER)
        assert consumed.external_hit_tokens == 32
        assert dict(consumed.loaded) == {0: {0, 1}, 1: {5, 6, 7}}
        assert assert_restored_bitwise(host_b, consumed, before) == 5
        # per kvtier tier, in the tier's statistics and in vLLM's stats hook (its Prometheus metrics):
        # 5 chunks from the remote (2 FA chunks of 16 tokens, 3 SWA chunks of 4), none from disk
        row = tier.layout.primary_row_bytes
        assert {k: v for k, v in tier.statistics().items() if k.startswith(("vllm_disk_", "vllm_remote_"))
                and not k.endswith("_load_s")} == {
            "vllm_remote_hits": 5.0, "vllm_remote_hit_tokens": 44.0, "vllm_remote_hit_bytes": 5.0 * row}
        total = OffloadingConnectorStats()
        for payload in host_b.connector_stats:
            total.aggregate(OffloadingConnectorStats(data=payload))
        types, values = total.metric_sections()
        assert values["vllm:kvtier_tier_hits"] == {("remote",): 5}
        assert values["vllm:kvtier_tier_hit_tokens"] == {("remote",): 44}
        assert values["vllm:kvtier_tier_hit_bytes"] == {("remote",): 5 * row}
        assert list(values["vllm:kvtier_tier_load_seconds"]) == [("remote",)]
        assert types["vllm:kvtier_tier_load_seconds"] == "histogram"
        assert set(type(tier).build_metric_definitions({})) <= set(values)
        # vLLM's spec declares them to its Prometheus logger (it loads each secondary tier's definitions)
        extra = host_b.vllm_config.kv_transfer_config.kv_connector_extra_config
        from kvtier.integrations.vllm.testing import CpuTieringOffloadingSpec

        assert set(type(tier).build_metric_definitions({})) <= set(CpuTieringOffloadingSpec.build_metric_definitions(extra))
    finally:
        host_b.shutdown()


def damage(data_file, how: str) -> bytes:
    """Damage a data.mdb: ``garbage`` (random bytes), ``truncated`` (half of it), or ``leak`` (both
    meta pages claim one page more than any table uses: only py-lmdb's verifier notices; LMDB and
    kvtier's own open checks serve the file as it is). Returns the damaged bytes."""
    data = bytearray(data_file.read_bytes())
    if how == "garbage":
        data = bytearray(random.Random(7).randbytes(len(data)))
    elif how == "truncated":
        data = data[: len(data) // 2]
    else:
        psize = struct.unpack_from("<I", data, 40)[0]
        for meta in (0, psize):  # last_pg of each meta page, at byte 136
            struct.pack_into("<Q", data, meta + 136, struct.unpack_from("<Q", data, meta + 136)[0] + 1)
        last = max(struct.unpack_from("<Q", data, meta + 136)[0] for meta in (0, psize))
        data += bytes(max(0, (last + 1) * psize - len(data)))
    data_file.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("how", ["garbage", "truncated", "leak"])
def test_a_damaged_cache_dir_is_checked_moved_aside_and_replaced_under_vllm(tmp_path, how, caplog):
    """As the engine does, by default: the LMDB file is verified before LMDB maps it, and a damaged
    cache directory is moved aside (where to is logged and kept on the tier) and vLLM starts on an
    empty one. With quarantine_corrupt_cache_dir off the start fails and the directory stays."""
    rig = make_rig(tmp_path)
    try:
        rig.run(PROMPT)
    finally:
        rig.shutdown()
    cache = tmp_path / "kv"
    if how == "leak":
        # Only the verifier sees this damage: with lmdb_verify_on_open off, a copy is served as is.
        unchecked = tmp_path / "unchecked"
        shutil.copytree(cache, unchecked / "kv")
        damage(unchecked / "kv" / "data.mdb", how)
        served = make_rig(unchecked, lmdb_verify_on_open=False)
        try:
            assert served.secondary_tiers[0].quarantined_cache_dir is None
            assert served.secondary_tiers[0].statistics()["indexed_chunks"] == 4
        finally:
            served.shutdown()
    broken = damage(cache / "data.mdb", how)

    with pytest.raises(CorruptCacheError):
        make_rig(tmp_path, quarantine_corrupt_cache_dir=False)
    assert (cache / "data.mdb").read_bytes() == broken  # left alone

    with caplog.at_level(logging.ERROR, logger="kvtier"):
        fresh = make_rig(tmp_path)
    try:
        tier = fresh.secondary_tiers[0]
        aside = tier.quarantined_cache_dir
        assert aside is not None and os.path.dirname(aside) == str(tmp_path)
        assert os.path.basename(aside).startswith("kv.corrupt-")
        with open(os.path.join(aside, "data.mdb"), "rb") as f:
            assert f.read() == broken  # kept for inspection
        assert [r for r in caplog.records if f"moved aside to {aside}, starting with an empty one" in r.getMessage()]
        assert tier.statistics()["indexed_chunks"] == 0  # a cold cache, not a wrong one
        consumed = fresh.run(CONSUMER)
        assert consumed.external_hit_tokens == 0
        assert tier.statistics()["indexed_chunks"] == 4  # and it serves: the consumer's stores landed
    finally:
        fresh.shutdown()


def test_a_server_over_a_read_only_mount_of_a_warmed_cache_serves_hits(tmp_path, caplog):
    """A warmed cache bind-mounted read-only (writes through the mount fail with EROFS): the server
    starts, says once that it serves read-only, hits 32 tokens bitwise, refuses its own stores (vLLM
    keeps its CPU copy) and leaves the directory as it was."""
    from mounts import bind_mount

    warmer = make_rig(tmp_path)
    try:
        warmer.run(PROMPT)
    finally:
        warmer.shutdown()
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "kv").iterdir())
    caplog.set_level("WARNING", logger="kvtier.integrations.vllm")
    with bind_mount(tmp_path / "kv", tmp_path / "ro", read_only=True) as ro:
        server = VllmCpuRig(group_specs(0), [tier_config(ro)], model_dir=tmp_path / "model")
        try:
            tier = server.secondary_tiers[0]
            assert tier.read_only
            consumed = server.run(CONSUMER)
            assert consumed.external_hit_tokens == 32
            assert dict(consumed.loaded) == {0: {0, 1}, 1: {6, 7}}
            for group, blocks in consumed.loaded.items():
                for logical in blocks:
                    assert server.block_bytes(group, consumed.block_ids[group][logical]) == server.expected_block(PROMPT, group, logical)
            server.run([11] * 33)  # a new prefix: its stores are refused, never written
            assert tier.counters["stores_refused_read_only"] >= 1 and tier.counters["promotions_failed"] == 0
        finally:
            server.shutdown()
    lines = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(lines) == 1 and "serving its records read-only" in lines[0]
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "kv").iterdir()) == before


def test_a_second_scheduler_writing_the_same_cache_dir_is_refused_at_start_in_one_line(tmp_path):
    """Two writers of one directory would admit hits for keys the other evicted: a second server
    process on this server's cache_dir is refused at start, in one line naming the directory and
    the holder; once this one shuts down, that server starts and hits what this one stored."""
    import subprocess
    import sys

    child = [sys.executable, str(Path(__file__).with_name("vllm_server_child.py")), "serve", str(tmp_path / "kv"), "sha256"]
    first = make_rig(tmp_path)
    try:
        first.run(PROMPT)
        refused = subprocess.run(child, capture_output=True, text=True, timeout=300)
    finally:
        first.shutdown()
    assert refused.returncode != 0
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("kvtier.integrations.vllm.tier.CacheDirInUseError")]
    assert line == (f"kvtier.integrations.vllm.tier.CacheDirInUseError: kvtier: cache_dir {tmp_path / 'kv'} is already "
                    f"written by another KvtierTier (pid {os.getpid()}); two schedulers writing one directory are not "
                    "supported (its evictions would not reach this index): give each server its own cache_dir and "
                    "share through remote_url, or set read_only")
    served = subprocess.run(child, capture_output=True, text=True, timeout=300)
    assert served.returncode == 0, served.stderr[-3000:]
    assert json.loads(served.stdout.splitlines()[-1])["hit_tokens"] == 32


def test_kv_events_announce_what_kvtier_stores_and_what_it_loses_with_its_medium(tmp_path):
    """With vLLM's KV events on and ``enable_kv_events``: every chunk kvtier stores is announced
    as a BlockStored with medium STORAGE (a KV-aware router can route that prefix here), and a
    chunk kvtier evicts is announced as a BlockRemoved, after its store; a key announced removed
    is not in the tier any more."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    # room for one prompt's 4 raw records: the second prompt's stores evict the first's
    rig = VllmCpuRig(group_specs(0), [tier_config(tmp_path / "kv", enable_kv_events=True, compression=0,
                                                  disk_capacity_bytes=20000)],
                     model_dir=tmp_path / "model", kv_events=True)
    try:
        tier = rig.secondary_tiers[0]
        rig.run(PROMPT)
        second = [11] * 33
        rig.run(second)
        evictions = int(tier.statistics()["evictions"])
        deadline = time.monotonic() + 10
        while int(tier.statistics()["indexed_chunks"]) > 8 - evictions and time.monotonic() < deadline:
            time.sleep(0.02)  # the removals reach the index (and the events) at the next steps
            rig.step()
        rig.step()  # publishes what the last drain queued
        ours = [e for e in rig.kv_events.events if e.medium == "STORAGE"]
        stored = [h for e in ours if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in ours if isinstance(e, BlockRemoved) for h in e.block_hashes]
        # 2 prompts x (2 FA + 2 SWA chunks); FA chunk 1 and SWA chunk 7 end on one block hash
        assert len(stored) == 8 and set(stored[:4]).isdisjoint(stored[4:])
        assert evictions >= 1 and len(removed) == evictions
        assert set(removed) <= set(stored[:4])  # only the first prompt's chunks went
        order = [(type(e).__name__, h) for e in ours for h in e.block_hashes]
        for h in removed:
            assert order.index(("BlockStored", h)) < order.index(("BlockRemoved", h))
        assert int(tier.statistics()["indexed_chunks"]) == 8 - evictions
    finally:
        rig.shutdown()
