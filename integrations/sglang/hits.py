"""``batch_exists_v2``'s answer from per-page presence: which prefix lengths SGLang can restore.

SGLang asks, for a request's pages ``0 .. n-1``, the longest contiguous KV prefix stored and, per
side pool, by its hit policy: ALL_PAGES (every page of the prefix, e.g. DSA's indexer), TRAILING_PAGES
(only the last ``N`` pages of a prefix: an SWA window, a Mamba state), BLOCK_GROUPS (whole groups of
pages from the span start: the pool's own verdict, never gating the KV hit). A TRAILING_PAGES pool
leaves holes (a window may be stored at 5 pages and 3, not at 4), so the answer is the set of
restorable prefix lengths, which SGLang intersects across ranks.

A TRAILING_PAGES pool is a sliding-window group in ``kvtier.policy``'s terms, one page a block:
window ``N + 1`` (the new token attends to ``N`` pages back), so ``retained_chunk_range`` of a
prefix of ``p`` pages is pages ``[max(0, p - N), p)``, the window SGLang then loads. The answer is
the same fold as SGLang's ``HiCacheFile`` and Mooncake backends (the tests compare it with
``HiCacheFile`` on generated cases), computed in O(pages) per pool with prefix sums.

Pure, any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Dict, Hashable, List, Sequence, Tuple

from kvtier.policy import AttentionGroup, retained_chunk_range

__all__ = ["PoolQuery", "restorable_prefixes", "trailing_window_group", "ALL_PAGES", "TRAILING_PAGES", "BLOCK_GROUPS"]

# SGLang's PoolHitPolicy values (a str enum there; compared by value here, no SGLang import).
ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"


@dataclass(frozen=True)
class PoolQuery:
    """One side pool of a query: its name, hit policy value, ``trailing`` (N, for TRAILING_PAGES),
    ``group_pages`` (for BLOCK_GROUPS) and whether each of the request's first pages is stored."""

    name: Hashable
    policy: str
    present: Sequence[bool]
    trailing: int = 1
    group_pages: int = 0


def trailing_window_group(trailing_pages: int) -> AttentionGroup:
    """The sliding-window group (one page a block) whose retained window is the last
    ``trailing_pages`` pages of a prefix."""
    return AttentionGroup(block_size=1, sliding_window=max(1, trailing_pages) + 1)


def _trailing_restorable(present: Sequence[bool], kv_pages: int, trailing: int) -> List[int]:
    group = trailing_window_group(trailing)
    missing_before = [0, *accumulate(0 if present[i] else 1 for i in range(kv_pages))]
    out = []
    for prefix in range(1, kv_pages + 1):
        first, last = retained_chunk_range(group, prefix)
        if missing_before[last + 1] - missing_before[first] == 0:
            out.append(prefix)
    return out


def _leading(present: Sequence[bool], limit: int) -> int:
    return next((i for i in range(limit) if not present[i]), limit)


def restorable_prefixes(kv_pages: int, pools: Sequence[PoolQuery], kv_name: Hashable = "kv",
                        ) -> Tuple[int, Dict[Hashable, int], List[int]]:
    """``(final_pages, hit pages per pool, restorable prefix lengths)`` for a request whose first
    ``kv_pages`` KV pages are stored, as ``PoolTransferResult`` carries them: the KV pool's count
    under ``kv_name`` (when non-zero; SGLang's ``PoolName.KV``, whose hash is not ``"kv"``'s), each pool's own longest restorable prefix (when non-zero), the
    ascending prefix lengths every gating pool can restore, and the longest of them. Pools after
    the set became empty are not reported (SGLang's fold stops there)."""
    hits: Dict[Hashable, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for pool in pools:
        if not restorable:
            break
        if pool.policy == ALL_PAGES:
            boundary = _leading(pool.present, kv_pages)
            allowed = set(range(1, boundary + 1))
        elif pool.policy == TRAILING_PAGES:
            ok = _trailing_restorable(pool.present, kv_pages, pool.trailing)
            boundary = ok[-1] if ok else 0
            allowed = set(ok)
        elif pool.policy == BLOCK_GROUPS:
            leading = _leading(pool.present, len(pool.present))
            size = pool.group_pages
            if size > 0:
                leading -= leading % size
            if leading:
                hits[pool.name] = leading
            continue
        else:
            raise ValueError(f"unknown pool hit policy {pool.policy!r}")
        if boundary:
            hits[pool.name] = boundary
        restorable = [p for p in restorable if p in allowed]
    return (restorable[-1] if restorable else 0), hits, restorable
