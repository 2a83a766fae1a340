"""Request traces for ``kvtier replay``: what each request sends, in trace order.

Primitives: ``Request``, ``Trace``, ``read_trace`` (format from the file: Mooncake JSONL with
``hash_ids``, kvtier's prompt JSONL with ``token_ids``, Azure 2023 CSV), ``block_tokens``
(the token ids a Mooncake block stands for), ``TraceFormatError``. Pure; any thread.

Mooncake's ``hash_ids`` are prefix hashes of 512-token blocks: an equal id at position ``i`` means
the whole prefix up to the end of that block is equal. There are no token ids, so they are
synthesised per block from its id (same id, same tokens; the last block partial per
``input_length``), deterministic across runs and machines (a 64-bit mix of id and position, no
random state). Azure 2023 traces carry arrivals and lengths only: each request gets tokens of its
own (block ids no other request has), so nothing is shared and every hit rate is 0 by construction
(``Trace.prefix_sharing`` False): use them for arrival processes and length distributions.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from datetime import datetime
from typing import List, Optional, Sequence

import numpy as np

from kvtier.errors import KvtierError

__all__ = ["Request", "Trace", "TraceFormatError", "read_trace", "block_tokens", "MOONCAKE_BLOCK_TOKENS", "VOCAB"]

MOONCAKE_BLOCK_TOKENS = 512
# Synthesised token ids stay below a common vocabulary size (Llama-2's); any value works for keys.
VOCAB = 32000
_MASK = (1 << 64) - 1


class TraceFormatError(KvtierError, ValueError):
    """A trace file that does not parse; the message names the file and the line."""


@dataclass(frozen=True)
class Request:
    """One request of a trace. ``block_ids`` (prefix-hash ids of ``block_tokens``-token blocks)
    or ``token_ids`` says what the prompt holds; every reader gives a request one of them (an
    Azure request, which shares nothing, gets block ids of its own)."""

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    block_ids: Optional[np.ndarray] = None
    token_ids: Optional[np.ndarray] = None


@dataclass
class Trace:
    path: str
    format: str  # "mooncake" | "prompts" | "azure"
    requests: List[Request]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    prefix_sharing: bool = True

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def limited(self, limit: Optional[int] = None, max_input_tokens: Optional[int] = None) -> "Trace":
        """The first ``limit`` requests, each prompt cut to ``max_input_tokens`` (a prefix of a
        prompt is a valid prompt: its block ids are the first ones)."""
        requests = self.requests[:limit] if limit is not None else list(self.requests)
        if max_input_tokens is not None:
            requests = [_truncated(r, max_input_tokens, self.block_tokens) for r in requests]
        return Trace(self.path, self.format, requests, self.block_tokens, self.prefix_sharing)


def _truncated(request: Request, max_tokens: int, block: int) -> Request:
    if request.input_length <= max_tokens:
        return request
    blocks = None if request.block_ids is None else request.block_ids[: -(-max_tokens // block)]
    tokens = None if request.token_ids is None else request.token_ids[:max_tokens]
    return Request(request.index, request.timestamp_ms, max_tokens, request.output_length, blocks, tokens)


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic)."""
    z = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def block_tokens(block_ids: Sequence[int] | np.ndarray, num_tokens: int, block: int = MOONCAKE_BLOCK_TOKENS) -> np.ndarray:
    """The ``num_tokens`` token ids of a prompt of Mooncake blocks: token ``j`` of a block with id
    ``h`` is a mix of ``(h, j)``, so equal ids give equal tokens wherever they occur."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    if num_tokens > len(ids) * block:
        raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // block)} blocks, got {len(ids)}")
    position = np.arange(num_tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):
        seeds = ids[position // np.uint64(block)] * np.uint64(0x100000001B3) + position % np.uint64(block)
    return (_mix64(seeds) % np.uint64(VOCAB)).astype(np.int64)


def read_trace(path: str, *, format: Optional[str] = None) -> Trace:
    """Read a trace; ``format`` (``mooncake``, ``prompts``, ``azure``) defaults to what the file
    holds: a ``.csv`` is Azure, a JSONL line with ``hash_ids`` Mooncake, one with ``token_ids``
    kvtier's prompt JSONL. Raises ``TraceFormatError`` naming the line at the first bad one."""
    if not os.path.isfile(path):
        raise TraceFormatError(f"--trace {path}: no such file")
    if format is None:
        format = "azure" if path.lower().endswith(".csv") else None
    if format == "azure":
        return _read_azure(path)
    if format not in (None, "mooncake", "prompts"):
        raise ValueError(f"trace format must be mooncake, prompts or azure, got {format!r}")
    return _read_jsonl(path, format)


def _fail(path: str, line: int, what: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{line}: {what}")


def _int_field(path: str, line: int, record: dict, name: str, minimum: int = 0) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, line, f"{name!r} must be an int >= {minimum}, got {value!r}")
    return value


def _read_jsonl(path: str, format: Optional[str]) -> Trace:
    requests: List[Request] = []
    with open(path, "r", encoding="utf-8") as handle:
        for number, text in enumerate(handle, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _fail(path, number, f"not JSON ({exc.msg} at column {exc.colno})") from None
            except ValueError as exc:  # no position: an integer past Python's digit limit
                raise _fail(path, number, f"not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise _fail(path, number, f"expected a JSON object, got {type(record).__name__}")
            kind = "mooncake" if "hash_ids" in record else "prompts" if "token_ids" in record else None
            if kind is None:
                raise _fail(path, number, "a line needs 'hash_ids' (Mooncake) or 'token_ids' (prompt JSONL)")
            if format is None:
                format = kind
            elif kind != format:
                raise _fail(path, number, f"a {kind} line in a {format} trace")
            requests.append(_mooncake(path, number, record, len(requests)) if kind == "mooncake"
                            else _prompt(path, number, record, len(requests)))
    if not requests:
        raise TraceFormatError(f"{path}: no requests")
    return Trace(path, format or "prompts", requests)


def _int_list(path: str, line: int, record: dict, name: str) -> np.ndarray:
    values = record.get(name)
    if not isinstance(values, list) or not values:
        raise _fail(path, line, f"{name!r} must be a non-empty list of ints")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        bad = next(v for v in values if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0))
        raise _fail(path, line, f"{name!r} must hold ints >= 0, found {bad!r}")
    return np.asarray(values, dtype=np.int64)


def _mooncake(path: str, line: int, record: dict, index: int) -> Request:
    length = _int_field(path, line, record, "input_length", 1)
    ids = _int_list(path, line, record, "hash_ids")
    expected = -(-length // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise _fail(path, line, f"input_length {length} needs {expected} hash_ids of {MOONCAKE_BLOCK_TOKENS} tokens, "
                    f"got {len(ids)}")
    timestamp = record.get("timestamp", 0)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
        raise _fail(path, line, f"'timestamp' must be a number (ms), got {timestamp!r}")
    output = record.get("output_length", 0)
    if isinstance(output, bool) or not isinstance(output, int) or output < 0:
        raise _fail(path, line, f"'output_length' must be an int >= 0, got {output!r}")
    return Request(index, float(timestamp), length, output, block_ids=ids)


def _prompt(path: str, line: int, record: dict, index: int) -> Request:
    tokens = _int_list(path, line, record, "token_ids")
    timestamp = record.get("timestamp", index)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
        raise _fail(path, line, f"'timestamp' must be a number (ms), got {timestamp!r}")
    return Request(index, float(timestamp), len(tokens), int(record.get("output_length", 0) or 0), token_ids=tokens)


_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _read_azure(path: str) -> Trace:
    requests: List[Request] = []
    start: Optional[datetime] = None
    with open(path, "r", encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header[:3]) != _AZURE_COLUMNS:
            raise _fail(path, 1, f"expected the header {','.join(_AZURE_COLUMNS)}, got {header!r}")
        for row in reader:
            number = reader.line_num
            if not row:
                continue
            if len(row) < 3:
                raise _fail(path, number, f"expected 3 columns, got {len(row)}")
            try:
                # Seven fractional digits: datetime takes six.
                stamp = datetime.fromisoformat(row[0].strip()[:26])
                context, generated = int(row[1]), int(row[2])
            except ValueError as exc:
                raise _fail(path, number, f"bad value ({exc})") from None
            if context < 1 or generated < 0:
                raise _fail(path, number, f"ContextTokens must be >= 1 and GeneratedTokens >= 0, got {context}, {generated}")
            start = start or stamp
            millis = (stamp - start).total_seconds() * 1000.0
            # Ids of its own per request (above any Mooncake id): arrivals and lengths, no sharing.
            blocks = np.arange(-(-context // MOONCAKE_BLOCK_TOKENS), dtype=np.int64) + ((len(requests) + 1) << 32)
            requests.append(Request(len(requests), millis, context, generated, block_ids=blocks))
    if not requests:
        raise TraceFormatError(f"{path}: no requests")
    return Trace(path, "azure", requests, prefix_sharing=False)
