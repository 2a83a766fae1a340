"""``run_bench`` and the ``kvtier bench`` command: the order of the parts, the report they fill."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch

from kvtier.tiers.host import HostSlabPool

from ._busy import BUSY_KINDS, busy, busy_label
from ._compressed import deepseek_v4_store_figures
from ._figures import gemma3_kv_bytes, measure_compression, measure_coverage, measure_longest_hit
from ._kv import KVGeometry, make_kv_bytes, measure_memcpy, measure_piece_copy, measure_staging
from ._machine import drop_caches_possible, drop_page_cache, filesystem_of, prefault
from ._report import BenchReport, BenchRow, format_report, judge, ratio_of
from ._rounds import run_paired
from ._settings import (
    LAYERS,
    MiB,
    SIZES,
    TARGET_BOOKKEEPING_US,
    TARGET_LONGEST_HIT_MS,
    TARGET_RELEASE_VS_STAGING,
    TARGET_STAGING_VS_MEMCPY,
    label_of,
    mb_s,
    run_plan,
)
from ._peers import PEER_SKIPS, peer_specs
from ._release import measure_engine_release
from ._subjects import TIER_SUBJECTS, DiskSubject, EngineSubject, RawFile, RowContext

__all__ = ["run_bench", "run_bench_command"]


def _progress(enabled: bool) -> Callable[[str], None]:
    def say(text: str) -> None:
        if enabled:
            print(f"kvtier bench: {text}", file=sys.stderr, flush=True)

    return say


async def run_bench(
    *,
    quick: bool = False,
    cache_dir: Optional[str] = None,
    sizes: Sequence[int] = SIZES,
    total_bytes: Optional[int] = None,
    parts: Optional[Set[str]] = None,
    gemma_seq_len: Optional[int] = None,
    rounds: Optional[int] = None,
    progress: bool = False,
    peers: Optional[bool] = None,
    busy_kinds: Optional[Sequence[str]] = None,
) -> BenchReport:
    """Run the benchmark (see the module docstring). ``parts`` limits it to some of ``"tiers"``
    (limits, baseline, LMDB, files, staging), ``"engine"`` (end to end), ``"bookkeeping"``,
    ``"policy"`` (longest_hit and coverage), ``"compression"`` and ``"remote"`` (Valkey node and
    cluster against memcpy and LMDB, engine load from the remote: ``tools/bench/_remote.py``); ``total_bytes`` overrides the
    bytes moved per chunk size, ``rounds`` the paired rounds per size (default 4, quick 3: the same
    256 MiB rounds, fewer of them: ``_settings.run_plan``). ``peers`` (default: true, quick or not,
    so both runs' rounds hold the same subjects in the same order) adds vLLM's, LMCache's and
    SGLang's disk tiers where importable (their imports alone take 10-20 s on 2 busy cores); the
    O_DIRECT limit always runs with the tiers. ``busy_kinds``
    (default: ``("threads",)``, none with ``quick``): after the quiet paired rounds of a size, the
    same rounds again beside CPU-bound workers of each kind (``_busy``), their rows named so. The cache directory gets a
    fresh ``kvtier-bench-*`` subdirectory, removed at the end. Torch runs one intra-op thread
    meanwhile (restored after): on 2 cores its second thread only adds wake-up jitter to the copies,
    and the tiers' own threads need the other core."""
    plan = run_plan(quick)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return await _run_bench(quick=quick, cache_dir=cache_dir, sizes=sizes, total_bytes=total_bytes or plan.total_bytes,
                                parts=parts, gemma_seq_len=gemma_seq_len, rounds=rounds or plan.rounds, progress=progress,
                                peers=plan.peers if peers is None else peers,
                                busy_kinds=tuple(plan.busy if busy_kinds is None else busy_kinds))
    finally:
        torch.set_num_threads(threads)


async def _run_bench(*, quick: bool, cache_dir: Optional[str], sizes: Sequence[int], total_bytes: int,
                     parts: Optional[Set[str]], gemma_seq_len: Optional[int], rounds: int,
                     progress: bool, peers: bool, busy_kinds: Sequence[str]) -> BenchReport:
    all_parts = {"tiers", "engine", "bookkeeping", "policy", "compression", "remote"}
    parts = set(all_parts if parts is None else parts)
    unknown = parts - all_parts
    if unknown:
        raise ValueError(f"unknown bench parts {sorted(unknown)}; choose from {sorted(all_parts)}")
    for kind in busy_kinds:
        if kind not in BUSY_KINDS:
            raise ValueError(f"unknown busy kind {kind!r}; choose from {list(BUSY_KINDS)}")
    say = _progress(progress)
    total = total_bytes
    for size in sizes:
        KVGeometry.for_chunk(size)  # validates
        if total < size:
            raise ValueError(f"total bytes {total} below the chunk size {size}")
    parent = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=parent))
    report = BenchReport()
    fs = filesystem_of(work)
    report.machine.update(
        {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lmdb": __import__("lmdb").__version__,
            "cache_dir": str(parent),
            "filesystem": f"{fs['type']} on {fs['device']} at {fs['mount']}",
            "page_cache_drop_possible": drop_caches_possible(),
            "page_cache_drop": ("fadvise DONTNEED + drop_caches" if drop_page_cache([])
                                else "fadvise DONTNEED only (drop_caches needs root)"),
            "quick": quick,
            "bytes_per_chunk_size": total,
            "paired_rounds_per_size": rounds,
            "peers": peers,
            "busy": [busy_label(kind).lstrip(", ") for kind in busy_kinds],
            "torch_threads": 1,
            "noise": {},
        }
    )
    try:
        free = shutil.disk_usage(work).free
        if "tiers" in parts or "engine" in parts:
            # every subject keeps its copy until the size is done
            need = (len(TIER_SUBJECTS) + len(peer_specs(work, peers=peers)) + 3) * total + 256 * MiB
            if free < need:
                raise ValueError(f"{parent} has {free >> 20} MiB free; the bench needs about {need >> 20} MiB")
        raw_write_ref: Dict[int, float] = {}
        if "tiers" in parts or "engine" in parts:
            say(f"touching {(5 * total) >> 20} MiB of memory once (first-touch cost off the clock)")
            report.machine["memory_first_touch_gb_s"] = round(prefault(5 * total), 2)
            say(f"generating {total >> 20} MiB of bf16 KV-like bytes")
            kv = make_kv_bytes(total)
            for size in sizes:
                await _bench_size(report, work, kv, size, total, parts, rounds, raw_write_ref, say, peers, quick,
                                  busy_kinds)
            del kv
            gc.collect()
        if "bookkeeping" in parts:
            say("engine bookkeeping")
            from kvtier.tools.bench.engine import measure_bookkeeping

            bk = await measure_bookkeeping(rounds=3 if quick else 7)
            report.add(
                "engine bookkeeping per chunk (store+lookup+load)", bk.total_us_per_chunk, "us",
                bk.total_us_per_chunk / TARGET_BOOKKEEPING_US, f"target {TARGET_BOOKKEEPING_US:g} us",
                target=f"<= {TARGET_BOOKKEEPING_US:g} us", met=bk.total_us_per_chunk <= TARGET_BOOKKEEPING_US,
            )
            report.add(
                "  of which store", bk.store_us_per_chunk, "us", None,
                f"lookup {bk.lookup_us_per_chunk:.1f} us, load {bk.load_us_per_chunk:.1f} us; keys "
                f"{bk.keys_us_per_chunk:.1f} us apart; best of {bk.rounds} rounds, median "
                f"{bk.median_total_us_per_chunk:.1f} us",
            )
        if "policy" in parts:
            say("longest_hit and coverage")
            lh = measure_longest_hit(repeats=3 if quick else 5)
            for name in ("full", "diverging"):
                report.add(
                    f"longest_hit 131072 tokens, 3 groups, {name} (hit {int(lh[name + '_hit'])})",
                    lh[name], "ms", lh[name] / TARGET_LONGEST_HIT_MS, f"target {TARGET_LONGEST_HIT_MS:g} ms",
                    target=f"<= {TARGET_LONGEST_HIT_MS:g} ms", met=lh[name] <= TARGET_LONGEST_HIT_MS,
                )
            for r in (0, 3):
                cov = await measure_coverage(r)
                stored = cov["stored"] / MiB
                report.add(f"SWA store bytes, R={r}, 100K tokens", stored, "MiB", ratio_of(cov["stored"], cov["every"]),
                           f"storing every SWA chunk ({cov['every'] / MiB:.1f} MiB)")
                row = report.add(f"SWA store bytes vs minimal set, R={r}", stored, "MiB",
                                 ratio_of(cov["stored"], cov["minimal"]), "brute-force minimal set",
                                 target="== 1.0x", met=bool(cov["equal"]))
                if not cov["equal"]:
                    report.failures.append(f"SWA coverage R={r}: " + "; ".join(cov["diff"]))
                    row.ratio = ratio_of(cov["stored"], cov["minimal"])
                report.add(f"SWA store bytes vs cross-group reachable set, R={r}", stored, "MiB",
                           ratio_of(cov["stored"], cov["cross_group"]),
                           "boundaries every group can serve (info)")
            for r in (0, 3):
                for p in (1, 4):
                    for figure in deepseek_v4_store_figures(r, blocks_per_chunk=p):
                        report.add(
                            f"DeepSeek-V4-Flash {figure['group']} bytes stored, R={r}, b=64 p={p}, 100K tokens",
                            figure["stored"] / MiB, "MiB", ratio_of(figure["stored"], figure["every"]),
                            f"every complete chunk ({figure['every'] / MiB:.1f} MiB; hits every {figure['alignment']} tokens)",
                        )
        if "compression" in parts:
            say("compression on Gemma3 KV")
            seq = gemma_seq_len or 2048  # the same KV in both runs: a quick run repeats less, on the same bytes
            kv_u8 = gemma3_kv_bytes(seq)
            report.machine["gemma3_kv_bytes"] = kv_u8.numel()
            for size in sizes:
                if kv_u8.numel() < size:
                    continue
                c = measure_compression(kv_u8, size, repeats=2 if quick else 3)
                label = label_of(size)
                report.add(f"zstd byte planes ratio, Gemma3 bf16 KV {label}", c["ratio"], "x",
                           c["ratio"] / c["plain_ratio"], f"plain zstd-1 ({c['plain_ratio']:.2f}x)")
                write = raw_write_ref.get(size)
                report.add(f"byte-plane encode 1 thread {label}", c["encode_mb_s"], "MB/s",
                           ratio_of(c["encode_mb_s"], write) if write else None,
                           "raw fdatasync write" if write else "no disk figure in this run")
                report.add(f"byte-plane decode 1 thread {label}", c["decode_mb_s"], "MB/s",
                           ratio_of(c["decode_mb_s"], write) if write else None,
                           "raw fdatasync write" if write else "no disk figure in this run")
        if "remote" in parts:
            from ._remote import REMOTE_FULL_TOTAL_BYTES, REMOTE_QUICK_TOTAL_BYTES, measure_remote

            remote_total = min(total, REMOTE_QUICK_TOTAL_BYTES if quick else REMOTE_FULL_TOTAL_BYTES)
            await measure_remote(report, sizes, remote_total, min(rounds, 3), say, work=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.add("correctness checks failed (bytes read back, SWA coverage)", float(len(report.failures)), "count",
               None, "; ".join(report.failures)[:500] or "every byte read back matched", target="== 0",
               met=not report.failures)
    return report


async def _bench_size(report: BenchReport, work: Path, kv: torch.Tensor, size: int, total: int,
                      parts: Set[str], rounds: int, raw_write_ref: Dict[int, float],
                      say: Callable[[str], None], peers: bool, quick: bool, busy_kinds: Sequence[str]) -> None:
    label = label_of(size)
    geometry = KVGeometry.for_chunk(size)
    n = total // size
    src = kv.view(torch.uint8)[: n * size]
    say(f"{label}: {n} chunks")
    view = geometry.device_view(kv, n)
    pool = HostSlabPool(size, n)
    allocation = pool.allocate(n)
    assert allocation is not None, "a fresh pool of n slots has n free"
    slots = [pool.view(s) for s in allocation.slots]
    # Page-aligned, like the host slab: the O_DIRECT limit and vLLM's fs tier read into it directly.
    restore_raw = torch.empty(n * size + 4096, dtype=torch.uint8)
    restore = restore_raw[(-restore_raw.data_ptr()) % 4096 :][: n * size]
    restore.fill_(1)  # pre-fault: the copies below must not pay first-touch
    chunks = [s.numpy().data for s in slots]
    outs = [restore[i * size : (i + 1) * size].numpy().data for i in range(n)]

    memcpy = staging = 0.0
    if "tiers" in parts:
        pieces = 0.0
        for _ in range(3):  # alternate, best of each: memory bandwidth is shared with neighbours
            memcpy = max(memcpy, measure_memcpy(src, size, restore, repeats=1))
            pieces = max(pieces, measure_piece_copy(kv, geometry, n, restore))
            staging = max(staging, measure_staging(view, geometry, slots, repeats=1))
        report.add(f"memcpy {label}", memcpy, "MB/s", None, "limit")
        report.add(f"memcpy of the per-layer pieces ({LAYERS} layers) {label}", pieces, "MB/s", pieces / memcpy,
                   "memcpy (cost of the paged layout)")
        judge(report.add(f"staging device->host {label}", staging, "MB/s", staging / memcpy, "memcpy",
                          target=f">= {TARGET_STAGING_VS_MEMCPY}x"), TARGET_STAGING_VS_MEMCPY)
        report.add(f"staging device->host {label} vs pieces", staging, "MB/s", staging / pieces,
                   "memcpy of the per-layer pieces")
    else:
        view.gather_many_groups([(0, geometry.block_ids(c), slot) for c, slot in enumerate(slots)])

    k = max(1, min(rounds, n))
    step = n // k
    ranges = [range(i * step, (i + 1) * step if i < k - 1 else n) for i in range(k)]
    for kind in [None] + list(busy_kinds):
        say(f"{label}: disk rounds{busy_label(kind) or ' (quiet)'}")
        with busy(kind):
            engine = await _disk_rounds(report, work, kv, geometry, label, label + busy_label(kind), size, n,
                                        parts, ranges, chunks, outs, raw_write_ref if kind is None else {},
                                        say, peers)
        if engine is None:
            continue
        name = label + busy_label(kind)
        released = mb_s(n * size, engine.released_s)
        report.add(f"engine store until released {name}", released, "MB/s",
                   ratio_of(released, memcpy) if memcpy else None, "memcpy" if memcpy else None)
        if staging and kind is None:
            alone, paired = await measure_engine_release(view, geometry, slots, ranges)
            judge(report.add(f"engine store until released, host tier only {label}", alone, "MB/s",
                             statistics.median(paired),
                             "staging device->host of the same chunks, paired rounds (no spill competing)",
                             target=f">= {TARGET_RELEASE_VS_STAGING}x", per_round=paired), TARGET_RELEASE_VS_STAGING)
    del pool, slots, chunks, outs, restore, restore_raw
    gc.collect()


async def _disk_rounds(report: BenchReport, work: Path, kv: torch.Tensor, geometry: KVGeometry, label: str,
                      name: str, size: int, n: int, parts: Set[str], ranges: List[range],
                      chunks: List[memoryview], outs: List[memoryview], raw_write_ref: Dict[int, float],
                      say: Callable[[str], None], peers: bool) -> Optional[EngineSubject]:
    """One set of paired rounds over every disk subject of a chunk size, and their rows (named
    with ``name``: the size label, and what else ran beside them). Returns the engine subject
    that ran (its release time is reported by the caller), if any. The load average before and
    after goes into the report's machine notes."""
    load_before = os.getloadavg()
    subjects: List[DiskSubject] = [RawFile(work / f"raw-{label}", chunks, outs)]
    specs = list(TIER_SUBJECTS) + peer_specs(work, peers=peers) if "tiers" in parts else []
    for skipped in PEER_SKIPS if "tiers" in parts else []:
        if skipped not in report.machine.setdefault("peers_skipped", []):
            report.machine["peers_skipped"].append(skipped)
            # Said even without --progress: a table without a peer's rows must not look complete.
            print(f"kvtier bench: warning: {skipped}", file=sys.stderr, flush=True)
    if specs:
        subjects += [spec.make(work / f"{spec.directory}-{label}", chunks, outs) for spec in specs]
    engine: Optional[EngineSubject] = None
    if "engine" in parts:
        engine = EngineSubject(work / f"engine-{label}", kv, geometry, n, ranges)
        subjects.append(engine)
    times, failures = await run_paired(subjects, ranges, size, outs, chunks,
                                       say=lambda text: say(f"{name}: {text}"))
    report.failures.extend(f"{name}: {f}" for f in failures)
    for s in subjects:
        if s.name != "raw":
            shutil.rmtree(s.directory, ignore_errors=True)
    shutil.rmtree(work / f"raw-{label}", ignore_errors=True)

    raw_w, raw_r = times.mb_s("raw", "write"), times.mb_s("raw", "read")
    raw_write_ref[size] = raw_w
    report.machine["noise"][name] = {
        "raw_write_mb_s_per_round": [round(b / t / 1e6) for b, t in zip(times.round_bytes, times.write["raw"])],
        "raw_cold_read_mb_s_per_round": [round(b / t / 1e6) for b, t in zip(times.round_bytes, times.read["raw"])],
    }
    report.machine.setdefault("load_average", {})[name] = [round(x, 2) for x in load_before + os.getloadavg()]
    report.add(f"raw write+fdatasync {name}", raw_w, "MB/s", None, "limit")
    report.add(f"raw cold read {name}", raw_r, "MB/s", None, "limit")

    def add(row: str, subject: str, kind: str, reference: str, reference_label: str, **kw: Any) -> BenchRow:
        return report.add(row, times.mb_s(subject, kind), "MB/s", times.ratio(subject, kind, reference),
                          reference_label, per_round=times.round_ratios(subject, kind, reference), **kw)

    if "tiers" in parts:
        for spec, subject in zip(specs, subjects[1:]):
            spec.rows(RowContext(add, report, name, size, subject))
    if engine is not None:
        add(f"engine store until durable (zstd) {name}", "engine", "write", "raw", "raw fdatasync write")
        add(f"engine cold load (zstd) {name}", "engine", "read", "raw", "raw cold read")
    return engine


def run_bench_command(*, quick: bool = False, as_json: bool = False, cache_dir: Optional[str] = None,
                      busy_kinds: Optional[Sequence[str]] = None) -> int:
    """``kvtier bench``: run, print the table (or one JSON object), return the exit code: 1 when a
    correctness check failed (restored bytes, SWA coverage), else 0. Missed performance targets
    are reported, not failed."""
    report = asyncio.run(run_bench(quick=quick, cache_dir=cache_dir, progress=not as_json, busy_kinds=busy_kinds))
    if as_json:
        print(json.dumps(report.to_dict(), sort_keys=True))
        for failure in report.failures:
            print(f"kvtier bench: FAIL: {failure}", file=sys.stderr)
    else:
        print(format_report(report))
    return 1 if report.failures else 0
