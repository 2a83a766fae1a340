"""What an eviction policy's bookkeeping costs per chunk, at capacity, with many chunks indexed.

Primitives: ``measure_policies`` (returns a dict per policy name), ``main``
(``python -m kvtier.tools.bench.policies``). Pure Python on the calling thread.

Method. Per policy name, the host pool's policy object (``tiers.eviction``) tracking ``chunks``
slots and the disk tier's byte index (``tiers.lru``) holding ``chunks`` keys, both full. One step is
what a store of a new chunk costs the policy when the tier is full: the host evicts one victim
(``evictable_victims`` with every slot evictable) and inserts the new chunk, then touches a chunk
stored ``reuse`` steps before (a hit); the disk chooses and pops a victim for the new record, puts
it and touches the same older key. Disk admission (``tiers.admission``): one ``decide`` of the new
chunk's key by ``seen``, remembering ``WINDOW_FACTOR`` x twice ``chunks`` keys per generation, as
for host and disk of ``chunks`` each; a ``reuse``-old key comes back every step. The figure is the best of ``rounds`` rounds of ``steps`` steps,
in microseconds per step (the machine is shared: a neighbour only adds time), the median beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

from kvtier.tiers.admission import make_admission
from kvtier.tiers.eviction import eviction_policy_names, make_eviction_policy
from kvtier.tiers.lru import BYTE_INDEX_NAMES, make_byte_index

__all__ = ["measure_policies", "main"]


def _host_round(name: str, chunks: int, steps: int, reuse: int) -> float:
    policy = make_eviction_policy(name, chunks)
    for slot in range(chunks):
        policy.insert(slot, key=slot)
    keys = {slot: slot for slot in range(chunks)}  # slot -> key: a freed slot takes the new key
    slot_of = dict(keys)
    always = lambda slot: True  # noqa: E731 - every slot evictable, as a pool of ready chunks
    started = time.perf_counter()
    for step in range(steps):
        key = chunks + step
        victims = policy.evictable_victims(1, always)
        assert victims is not None
        slot = victims[0]
        del slot_of[keys[slot]]
        keys[slot] = key
        slot_of[key] = slot
        policy.insert(slot, key=key)
        old = slot_of.get(key - reuse)
        if old is not None:
            policy.touch(old)
    return (time.perf_counter() - started) / steps * 1e6


def _disk_round(name: str, chunks: int, steps: int, reuse: int) -> float:
    index = make_byte_index(name, ((key, 1) for key in range(chunks)))
    started = time.perf_counter()
    for step in range(steps):
        key = chunks + step
        victims = index.choose_victims(1)
        assert victims is not None
        for victim, _ in victims:
            index.pop(victim)
        index.put(key, 1)
        index.touch(key - reuse)
    return (time.perf_counter() - started) / steps * 1e6


def _admission_round(chunks: int, steps: int, reuse: int) -> float:
    admission = make_admission("seen", chunks, chunks)
    admission.decide(list(range(chunks)))
    started = time.perf_counter()
    for step in range(steps):
        key = chunks + step
        admission.decide([key, key - reuse])
    return (time.perf_counter() - started) / (2 * steps) * 1e6


def measure_policies(*, chunks: int = 100_000, steps: int = 20_000, rounds: int = 5, reuse: int = 1000,
                     names: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
    """Per policy name: ``host_us`` and ``disk_us`` per step (best round) and their medians."""
    results: Dict[str, Dict[str, float]] = {}
    for name in names or eviction_policy_names():
        host: List[float] = [_host_round(name, chunks, steps, reuse) for _ in range(rounds)]
        row = {"host_us": min(host), "host_median_us": statistics.median(host)}
        if name in BYTE_INDEX_NAMES:
            disk = [_disk_round(name, chunks, steps, reuse) for _ in range(rounds)]
            row.update(disk_us=min(disk), disk_median_us=statistics.median(disk))
        results[name] = row
    admission = [_admission_round(chunks, steps, reuse) for _ in range(rounds)]
    results["seen admission"] = {"admission_us": min(admission), "admission_median_us": statistics.median(admission)}
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.bench.policies",
                                     description="Eviction policy bookkeeping per stored chunk, at capacity.")
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    results = measure_policies(chunks=options.chunks, steps=options.steps, rounds=options.rounds)
    if options.json:
        print(json.dumps(results, sort_keys=True))
        return 0
    print(f"eviction bookkeeping per stored chunk at capacity ({options.chunks} chunks indexed; "
          f"evict one, insert, touch one), best of {options.rounds} rounds (median):")
    for name, row in results.items():
        if "admission_us" in row:
            print(f"  {name}: {row['admission_us']:.2f} us ({row['admission_median_us']:.2f}) per stored chunk's key")
            continue
        disk = f", disk {row['disk_us']:.2f} us ({row['disk_median_us']:.2f})" if "disk_us" in row else ""
        print(f"  {name:>10}: host {row['host_us']:.2f} us ({row['host_median_us']:.2f}){disk}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
