"""The remote tier's record codec and the threads it runs on.

Primitives:

- ``CodecThreads``: the tier's own ``ThreadPoolExecutor`` (``kvtier-remote-*``); ``run`` (event
  loop) hands a batch's codec work to it, one hop per slice (``tiers.codec_pool``: at most one
  slice per thread, >= 1 MiB each; zstd and the checksum release the GIL), or runs a small batch
  inline.
- ``encode_records`` / ``decode_records``: one slice of a put's encoding or a get's decoding, plain
  functions for those threads (any thread).
- ``Mismatch``: a decode outcome of an intact record that is not the caller's (another raw size,
  another fingerprint).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence, Tuple

from kvtier.errors import CorruptRecordError

from ..base import ChunkMeta
from ..codec_pool import MIN_SLICE_BYTES, map_slices
from ..record_format import CodecConfig, RecordMetaMismatchError, RecordSizeMismatchError, encode_record
from .getreader import decode_into

__all__ = ["CodecThreads", "Mismatch", "encode_records", "decode_records"]

# (server-side name, (chunk key, meta, the caller's bytes))
EncodeJob = Tuple[bytes, Tuple[bytes, ChunkMeta, memoryview]]
# (server-side name, fetched value, the caller's buffer)
DecodeJob = Tuple[bytes, Any, memoryview]


class Mismatch:
    """An intact record that is not the one asked for; ``foreign``: written for another fingerprint
    (never this tier's: delete it), else only of another raw size than the buffer (left in place).
    Made on a codec thread, read on the event loop."""

    __slots__ = ("reason", "foreign")

    def __init__(self, reason: str, foreign: bool) -> None:
        self.reason = reason
        self.foreign = foreign


def encode_records(part: Sequence[EncodeJob], codec: CodecConfig) -> List[bytes]:
    """The records of one slice of a put, keyed by their server-side names (any thread)."""
    return [encode_record(rkey, meta, raw, codec) for rkey, (_, meta, raw) in part]


def decode_records(part: Sequence[DecodeJob], fingerprint: Optional[bytes]) -> List[Any]:
    """Per fetched value of one slice: its ``ChunkMeta`` (decoded into the buffer), a ``Mismatch``,
    or the ``CorruptRecordError`` it raised (any thread)."""
    out: List[Any] = []
    for rkey, data, buf in part:
        try:
            meta = decode_into(rkey, data, buf)
        except RecordSizeMismatchError as exc:
            out.append(Mismatch(str(exc), False))
            continue
        except RecordMetaMismatchError as exc:
            out.append(Mismatch(str(exc), True))
            continue
        except CorruptRecordError as exc:
            out.append(exc)
            continue
        if fingerprint is not None and meta.fingerprint != fingerprint:
            out.append(Mismatch("record of another fingerprint", True))
            continue
        out.append(meta)
    return out


class CodecThreads:
    """The codec's worker threads (module docstring). ``run`` and ``shutdown`` on the event loop."""

    def __init__(self, threads: int) -> None:
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-remote")
        self._threads = threads

    async def run(self, fn: Callable[[Sequence[Any]], List[Any]], jobs: Sequence[Any],
                  sizes: Sequence[int], inline_below: int) -> List[Any]:
        """``fn`` over ``jobs`` (``sizes``: bytes per job), results in order; inline when the batch
        is under ``inline_below`` bytes. Cancelling it: slices already running finish on their
        threads; the results are dropped."""
        if not jobs:
            return []
        if sum(sizes) < inline_below:
            return fn(jobs)
        coding = map_slices(self._io, fn, jobs, sizes, workers=self._threads, min_slice_bytes=MIN_SLICE_BYTES)
        return await asyncio.wrap_future(coding)

    def shutdown(self) -> None:
        self._io.shutdown(wait=False)
