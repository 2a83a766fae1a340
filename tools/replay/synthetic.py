"""Synthetic prefix traces in the Mooncake format, to check eviction policies on shapes other than the
conversation trace (a policy tuned to one trace must not lose to LRU on another).

Primitives: ``SYNTHETIC_KINDS``, ``synthetic_records(kind, requests, seed)`` (the trace as a list of
Mooncake records: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
blocks with the prefix property), ``write_synthetic(kind, path, ...)``. Run as
``python -m kvtier.tools.replay.synthetic KIND OUT.jsonl [--requests N] [--seed S]``. Pure; any thread.

- ``agent``: a few long shared system prompts (Zipf popularity), agent runs of a geometric number of
  steps, each step re-sending the run's prompt plus a short tool result;
- ``chat``: multi-turn sessions of geometric length behind one short shared system prompt, each turn
  re-sending the history plus the last answer and a new message, sessions interleaved in time;
- ``scan``: mostly one-off documents (no sharing at all) with a minority of questions about a few
  popular documents.

Block ids follow the trace's rule: the full blocks a later request re-sends keep their ids, every
block with new content (including a partial block that grew) gets a fresh one.
"""

from __future__ import annotations

import argparse
import heapq
import json
from typing import Dict, Iterator, List, Tuple

import numpy as np

__all__ = ["SYNTHETIC_KINDS", "synthetic_records", "write_synthetic"]

BLOCK = 512
SYNTHETIC_KINDS = ("agent", "chat", "scan")


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> List[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _extend(ids: _Ids, blocks: List[int], tokens: int, added: int) -> Tuple[List[int], int]:
    """A prompt of ``tokens`` tokens held in ``blocks`` grown by ``added`` tokens: its full blocks
    kept, the rest (the old partial block and everything new) under fresh ids."""
    total = tokens + added
    keep = blocks[: tokens // BLOCK]
    return keep + ids.fresh(-(-total // BLOCK) - len(keep)), total


def _sessions(kind: str, rng: np.random.Generator, ids: _Ids) -> Iterator[List[Tuple[float, int, List[int]]]]:
    """Endless sessions, each a list of (seconds after its start, input tokens, block ids)."""
    if kind == "agent":
        prompts = [ids.fresh(n) for n in (24, 40, 16, 32)]
        popularity = 1.0 / np.arange(1, len(prompts) + 1)
        popularity /= popularity.sum()
        while True:
            head = prompts[int(rng.choice(len(prompts), p=popularity))]
            blocks, tokens, at = list(head), len(head) * BLOCK, 0.0
            steps: List[Tuple[float, int, List[int]]] = []
            for _ in range(int(rng.geometric(0.25))):
                blocks, tokens = _extend(ids, blocks, tokens, int(rng.integers(64, 1500)))
                steps.append((at, tokens, blocks))
                at += float(rng.exponential(15.0))
            yield steps
    elif kind == "chat":
        system = ids.fresh(1)
        while True:
            blocks, tokens, at = list(system), BLOCK, 0.0
            turns: List[Tuple[float, int, List[int]]] = []
            for _ in range(int(rng.geometric(0.3))):
                added = int(rng.integers(50, 2500)) + (int(rng.integers(100, 900)) if turns else 0)
                blocks, tokens = _extend(ids, blocks, tokens, added)
                turns.append((at, tokens, blocks))
                at += float(rng.exponential(90.0))
            yield turns
    elif kind == "scan":
        documents = [ids.fresh(int(n)) for n in rng.integers(10, 60, size=100)]
        weights = 1.0 / np.arange(1, len(documents) + 1) ** 1.1
        weights /= weights.sum()
        while True:
            if rng.random() < 0.8:
                n = int(rng.integers(8 * BLOCK, 160 * BLOCK))
                yield [(0.0, n, ids.fresh(-(-n // BLOCK)))]
            else:
                doc = documents[int(rng.choice(len(documents), p=weights))]
                blocks, tokens = _extend(ids, list(doc), len(doc) * BLOCK, int(rng.integers(20, 400)))
                yield [(0.0, tokens, blocks)]
    else:
        raise ValueError(f"unknown synthetic trace kind {kind!r}; valid: {', '.join(SYNTHETIC_KINDS)}")


def synthetic_records(kind: str, requests: int = 4000, seed: int = 0) -> List[Dict[str, object]]:
    """``requests`` Mooncake records of trace ``kind``, in arrival order (sessions start at 4 a
    second, Poisson), deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    sessions = _sessions(kind, rng, ids)
    pending: List[Tuple[float, int, int, List[int]]] = []  # (arrival s, order, tokens, blocks)
    start, order = 0.0, 0
    out: List[Dict[str, object]] = []
    while len(out) < requests:
        # Start sessions until the next start lies beyond the earliest pending request.
        while not pending or start <= pending[0][0]:
            for at, tokens, blocks in next(sessions):
                heapq.heappush(pending, (start + at, order, tokens, blocks))
                order += 1
            start += float(rng.exponential(0.25))
        at, _, tokens, blocks = heapq.heappop(pending)
        out.append({"timestamp": int(at * 1000), "input_length": tokens,
                    "output_length": int(rng.integers(50, 900)), "hash_ids": blocks})
    return out


def write_synthetic(kind: str, path: str, requests: int = 4000, seed: int = 0) -> None:
    with open(path, "w") as f:
        for record in synthetic_records(kind, requests, seed):
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.replay.synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=SYNTHETIC_KINDS)
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_synthetic(args.kind, args.out, args.requests, args.seed)


if __name__ == "__main__":
    main()
