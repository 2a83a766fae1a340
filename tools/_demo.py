"""``kvtier demo``: the main job on an embedded default, checked byte for byte.

Primitives: ``DEMO_LAYOUT``, ``run_demo`` (async; returns a ``DemoSummary``), ``format_summary``.
Runs on the caller's event loop; copies and disk I/O run on the engine's threads.

What it does: a built-in hybrid layout (full attention + sliding window with MTP extra retained
tokens 3) over CPU bfloat16 KV tensors. Producer requests sharing system prompts store their KV
through the engine and their device blocks are dropped. Consumers (each producer's prompt plus a
new turn) look up and load, first from the host tier, then, after a restart of the engine on the
same cache directory, from disk alone. Every loaded byte is compared with what its producer wrote.

A producer's KV bytes are a function of its chunk keys (as a real model's KV is a function of the
prefix), so the check holds whichever run stored a chunk: a second demo on the same directory, or
one after an interrupted demo, finds the earlier chunks already cached ("warm"), loads them, and
checks them against the bytes this run would have written.
With a remote tier (``remote_url``; ``kvtier demo --remote embedded`` starts a local Valkey), the
stores also write behind to the remote, and a third engine over a new, empty cache directory (a
second host) is served from the remote alone.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Set

import torch

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.errors import TierIOError
from kvtier.policy import AttentionGroup, ModelLayout, layout_fingerprint

from .testing.scenario import OffloadScenario, make_cpu_device

__all__ = ["DEMO_LAYOUT", "DemoSummary", "run_demo", "format_summary"]

# Full attention: 16-token blocks, 4 per chunk (64-token chunks). Sliding window 128 with MTP's
# 3 extra retained tokens: 16-token blocks, one per chunk.
DEMO_LAYOUT = ModelLayout(
    groups=(
        AttentionGroup(16, blocks_per_chunk=4),
        AttentionGroup(16, sliding_window=128, extra_retained_tokens=3),
    )
)
_LAYERS, _KV_HEADS, _HEAD_DIM = 4, 4, 64
# Part of the fingerprint: bump it when the demo's bytes-per-key function changes, so a directory
# written by an older demo holds other keys instead of bytes this demo would call wrong.
_DEMO_WEIGHTS_VERSION = "demo-2"


class _KeyedScenario(OffloadScenario):
    """Producers' KV bytes derive from the chunk key, and every complete chunk's bytes are known
    to the checker, whether this run stored it or found it already cached."""

    def fill_blocks(self, keys, table) -> None:
        super().fill_blocks(keys, table)  # random bytes for the trailing partial blocks
        for g, group_keys in enumerate(keys.keys):
            per_chunk = self.layout.groups[g].blocks_per_chunk
            for chunk, key in enumerate(group_keys):
                seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
                generator = torch.Generator().manual_seed(seed)
                blocks = table[g][chunk * per_chunk : (chunk + 1) * per_chunk]
                for block in blocks:
                    for layer in self._layers(g):
                        view = layer[block].view(torch.uint8).view(-1)
                        view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8, generator=generator))
                self.producer_bytes[key] = [self._block_bytes(g, block) for block in blocks]


@dataclass
class DemoSummary:
    verified: bool
    requests: int
    producers: int
    consumers: int
    hit_tokens: int
    prompt_tokens: int
    warm_chunks: int  # chunks the producers found already in the cache directory (an earlier run)
    stored_chunks: int  # chunks this run stored
    stored_bytes: int
    host_stored_bytes: int
    disk_stored_bytes: int
    disk_file_bytes: int
    loaded_bytes_from_host: int
    loaded_bytes_from_disk: int
    swa_bytes_stored: int
    swa_bytes_every_chunk: int
    swa_bytes_saved_ratio: float
    seconds: float
    load_throughput_mb_s: float
    cache_dir: Optional[str]  # None once the command removed its temporary directory
    failures: List[str]
    remote_url: Optional[str] = None
    loaded_bytes_from_remote: int = 0
    corrupt_blocks_restored: int = 0  # blocks of chunks found corrupt on load, never served, stored again

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


async def run_demo(
    cache_dir: str,
    *,
    producers: int = 12,
    prefixes: int = 3,
    seed: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    remote_url: Optional[str] = None,
) -> DemoSummary:
    """Run the demo over ``cache_dir``; ``progress(n)`` is called as requests complete. With
    ``remote_url`` the engine chains a remote tier behind LMDB and a fourth phase (a second host
    with an empty cache directory) loads from the remote alone."""
    rng = random.Random(seed)
    layout = DEMO_LAYOUT
    device = make_cpu_device(
        layout, num_blocks=640, num_layers=_LAYERS, kv_heads=_KV_HEADS, head_dim=_HEAD_DIM, dtype=torch.bfloat16
    )
    fingerprint = layout_fingerprint(layout, model="kvtier-demo", dtype="bfloat16", weights_version=_DEMO_WEIGHTS_VERSION)
    config = EngineConfig(cache_dir=cache_dir, host_capacity_bytes=96 << 20, lmdb_map_size_bytes=256 << 20)
    if remote_url is not None:
        # A fresh namespace per run: the demo proves its own bytes, not a previous run's.
        # A fleet member refreshes its index so other hosts' chunks become hits without a restart.
        config = dataclasses.replace(config, remote_url=remote_url, remote_namespace=f"demo-{os.getpid()}-{time.time_ns()}",
                                     disk_index_refresh_interval_s=10.0)
    tick = progress or (lambda n: None)
    failures: List[str] = []
    started = time.perf_counter()

    system_prompts = [[rng.randrange(32000) for _ in range(rng.randrange(300, 500))] for _ in range(prefixes)]
    prompts = []
    for i in range(producers):
        prefix = system_prompts[i % prefixes]
        prompts.append(prefix + [rng.randrange(32000) for _ in range(rng.randrange(40, 400))])

    swa_group = 1
    swa_chunk_bytes = device.chunk_nbytes(swa_group)
    # The distinct SWA chunks held for these prompts (stored now or found already cached) against
    # every complete SWA chunk of every prompt: shared prefixes are held once and the store mask
    # skips what no boundary needs. The same figure on a cold or a warm directory.
    swa_every = sum(len(p) // layout.groups[swa_group].tokens_per_chunk for p in prompts) * swa_chunk_bytes
    swa_keys: Set[bytes] = set()
    restored: List[int] = []  # blocks stored again per consumer whose load found a corrupt chunk
    stored_keys: Set[bytes] = set()
    warm_keys: Set[bytes] = set()
    hit_tokens = 0
    prompt_tokens = 0
    loaded_host = loaded_disk = 0

    async with OffloadEngine(layout, device, config, fingerprint=fingerprint) as engine:
        if remote_url is not None and engine.disk_tier is not None and engine.disk_tier.degraded:
            # Every second-host load would miss: an environment problem, not a verification.
            raise TierIOError(f"--remote {remote_url} is unreachable; start it, fix the URL, or leave --remote out")
        scenario = _KeyedScenario(engine, seed=seed)
        for prompt in prompts:
            keys = engine.request_keys(prompt)
            record = await scenario.produce(prompt)
            swa_keys.update(keys.keys[swa_group][b // layout.groups[swa_group].blocks_per_chunk] for b in record.stored[swa_group] | record.skipped[swa_group])
            for g, blocks in record.stored.items():
                per_chunk = layout.groups[g].blocks_per_chunk
                stored_keys.update(keys.keys[g][b // per_chunk] for b in blocks)
            for g, blocks in record.skipped.items():
                per_chunk = layout.groups[g].blocks_per_chunk
                warm_keys.update(keys.keys[g][b // per_chunk] for b in blocks)
            if not record.durable:
                _raise_if_disk_full(cache_dir)
                failures.append(f"producer of {len(prompt)} tokens: chunks not durable")
            tick(1)
        hits, host_loaded = await _consume_all(scenario, prompts, rng, failures, tick, restored)
        hit_tokens += hits
        prompt_tokens += sum(len(p) + 1 for p in prompts)
        stats = engine.statistics()
        host_stored = stats["stored_bytes"].get("host", 0)
        disk_stored = stats["stored_bytes"].get("disk", 0)
        loaded_host = stats["loaded_bytes"].get("device", 0)
        producer_bytes = scenario.producer_bytes

    async def consume_restarted(phase_config: EngineConfig, phase_seed: int):
        """A fresh engine over ``phase_config``'s directory serves every consumer: what it hit,
        its statistics, and its disk tier's (checked before it closes)."""
        async with OffloadEngine(layout, device, phase_config, fingerprint=fingerprint) as engine:
            scenario = _KeyedScenario(engine, seed=phase_seed)
            scenario.producer_bytes = producer_bytes
            hits, _ = await _consume_all(scenario, prompts, rng, failures, tick, restored)
            stats = engine.statistics()
            tier_stats = engine.disk_tier.statistics().as_dict() if engine.disk_tier is not None else {}
            engine.check()
        return hits, stats, tier_stats

    # Restart on the same directory: the consumers are served from disk alone.
    hits, stats, _ = await consume_restarted(config, seed + 1)
    hit_tokens += hits
    prompt_tokens += sum(len(p) + 1 for p in prompts)
    loaded_disk = stats["loaded_bytes"].get("disk", 0)
    file_bytes = int((stats["disk"] or {}).get("bytes", 0))

    loaded_remote = 0
    if remote_url is not None:
        # A second host: an empty cache directory, the same remote. Every hit comes from the remote.
        other_dir = tempfile.mkdtemp(prefix="kvtier-demo-host2-")
        try:
            other = dataclasses.replace(config, cache_dir=other_dir)
            hits, stats, tier_stats = await consume_restarted(other, seed + 2)
            hit_tokens += hits
            prompt_tokens += sum(len(p) + 1 for p in prompts)
            loaded_remote = stats["loaded_bytes"].get("disk", 0)
            if not tier_stats.get("hits.remote", 0):
                failures.append("second host: no chunk came from the remote tier")
        finally:
            shutil.rmtree(other_dir, ignore_errors=True)

    seconds = time.perf_counter() - started
    swa_stored = len(swa_keys) * swa_chunk_bytes
    moved = loaded_host + loaded_disk + loaded_remote
    phases = 4 if remote_url is not None else 3
    return DemoSummary(
        verified=not failures,
        requests=phases * producers,
        producers=producers,
        consumers=(phases - 1) * producers,
        hit_tokens=hit_tokens,
        prompt_tokens=prompt_tokens,
        warm_chunks=len(warm_keys - stored_keys),
        stored_chunks=len(stored_keys),
        stored_bytes=disk_stored or host_stored,
        host_stored_bytes=host_stored,
        disk_stored_bytes=disk_stored,
        disk_file_bytes=file_bytes,
        loaded_bytes_from_host=loaded_host,
        loaded_bytes_from_disk=loaded_disk,
        swa_bytes_stored=swa_stored,
        swa_bytes_every_chunk=swa_every,
        swa_bytes_saved_ratio=(1 - swa_stored / swa_every) if swa_every else 0.0,
        seconds=seconds,
        load_throughput_mb_s=moved / seconds / 1e6 if seconds > 0 else 0.0,
        cache_dir=cache_dir,
        failures=failures,
        remote_url=remote_url,
        loaded_bytes_from_remote=loaded_remote,
        corrupt_blocks_restored=sum(restored),
    )


# Less free space than this on the cache directory's filesystem when a store failed: the disk is
# full (one demo run writes ~40 MiB), and every later line would only be a consequence of it.
_FULL_DISK_FREE_BYTES = 16 << 20


def _raise_if_disk_full(cache_dir: str) -> None:
    free = shutil.disk_usage(cache_dir).free
    if free < _FULL_DISK_FREE_BYTES:
        raise OSError(errno.ENOSPC, f"No space left on device ({free} bytes free; the demo's stores could not be written)",
                      cache_dir)


async def _consume_all(scenario: OffloadScenario, prompts, rng, failures: List[str], tick, restored: List[int]):
    """Every prompt's follow-up as a consumer: its hit tokens and blocks loaded. A load that finds a
    chunk corrupt (detected, moved to quarantine, never served) is what a server recomputes: the
    prompt is stored again (``restored`` counts its chunks) and served once more."""
    hits = 0
    loaded = 0
    for prompt in prompts:
        follow_up = prompt + [rng.randrange(32000)]
        try:
            record = await scenario.consume(follow_up, allow_failed_load=True)
            if record.hit and not record.ok:
                if record.reason != "corrupt":
                    raise AssertionError(f"load of hit {record.hit} failed: {record.reason}")
                again = await scenario.produce(prompt)
                restored.append(sum(len(blocks) for blocks in again.stored.values()))
                record = await scenario.consume(follow_up)
        except AssertionError as exc:
            failures.append(str(exc))
            tick(1)
            continue
        if not record.hit:
            failures.append(f"consumer of {len(follow_up)} tokens: no hit")
        else:
            hits += record.hit
            loaded += sum(len(b) for b in record.loaded.values())
        tick(1)
    return hits, loaded


def format_summary(summary: DemoSummary) -> str:
    """A readable multi-line summary."""
    mib = 1 << 20
    lines = [
        "kvtier demo: " + ("every loaded byte matched its producer" if summary.verified else "VERIFICATION FAILED"),
        f"  requests            {summary.requests} ({summary.producers} producers, {summary.consumers} consumers)",
        f"  hit tokens          {summary.hit_tokens} of {summary.prompt_tokens} prompt tokens "
        f"({summary.hit_tokens / max(1, summary.prompt_tokens):.1%})",
        f"  producer chunks     {summary.stored_chunks} stored now, {summary.warm_chunks} already in the cache "
        "directory" + (" (warm: an earlier run stored them)" if summary.warm_chunks else ""),
    ]
    if summary.corrupt_blocks_restored:
        lines.append(
            f"  corrupt chunks      found on load, moved to quarantine, never served; their prompts stored again "
            f"({summary.corrupt_blocks_restored} blocks)"
        )
    lines += [
        f"  host tier           {summary.host_stored_bytes / mib:.1f} MiB stored, "
        f"{summary.loaded_bytes_from_host / mib:.1f} MiB loaded to device",
        f"  disk tier (LMDB)    {summary.disk_stored_bytes / mib:.1f} MiB stored "
        f"({summary.disk_file_bytes / mib:.1f} MiB of records), "
        f"{summary.loaded_bytes_from_disk / mib:.1f} MiB read back after restart",
    ]
    if summary.remote_url is not None:
        lines.append(
            f"  remote tier         {summary.remote_url}: {summary.loaded_bytes_from_remote / mib:.1f} MiB "
            "loaded by a second host with an empty cache directory"
        )
    lines += [
        f"  SWA coverage        {summary.swa_bytes_stored / mib:.1f} MiB held instead of "
        f"{summary.swa_bytes_every_chunk / mib:.1f} MiB for every chunk of every prompt "
        f"({summary.swa_bytes_saved_ratio:.1%} saved: shared prefixes held once, store mask)",
        f"  time                {summary.seconds:.2f} s, {summary.load_throughput_mb_s:.0f} MB/s loaded",
    ]
    for failure in summary.failures[:10]:
        lines.append(f"  failure: {failure}")
    return "\n".join(lines)
