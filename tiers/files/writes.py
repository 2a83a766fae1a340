"""The file tier's write side: a put batch from encoding to durable renames, eviction for room,
and the file operations under them.

``FileWrites`` runs on the event-loop thread (the index, reservations and the set of keys being
written are loop-only state, ``index.FileIndex``); every blocking call goes to the tier's I/O pool
through ``ops.FileOps``. A batch writes and fsyncs every temp file first, and only when all
succeeded renames them and fsyncs their directories, so a full disk fails the batch before any
reader could see a record of it; a failure after a rename removes what the batch renamed
(``_rollback``). ``FileTier`` builds it over its index and file operations.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any, List, Sequence, Tuple

from kvtier.errors import TierFullError, TierIOError

from ..base import ChunkMeta
from ..codec_pool import MIN_SLICE_BYTES, map_slices
from ..owned_tasks import wait_through_cancel
from ..record_format import CodecConfig, encode_record
from .index import FileIndex
from .layout import key_location
from .ops import FileOps

__all__ = ["FileWrites", "map_os_error"]


def map_os_error(exc: OSError, what: str) -> TierIOError:
    """``ENOSPC``/``EDQUOT`` -> ``TierFullError``, anything else -> ``TierIOError`` (caller chains)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(f"file tier: no space left while {what}: {exc}")
    return TierIOError(f"file tier: I/O error while {what}: {exc}")


def _encode_slice(
    items: Sequence[Tuple[bytes, ChunkMeta, memoryview]], codec: CodecConfig
) -> List[bytes]:
    """Runs on an I/O thread."""
    return [encode_record(key, meta, raw, codec) for key, meta, raw in items]


class FileWrites:
    """The write path of ``FileTier`` (event-loop thread only); see the module docstring."""

    def __init__(self, index: FileIndex, ops: FileOps, codec: CodecConfig) -> None:
        self._index = index
        self._ops = ops
        self._codec = codec

    async def put_batch(
        self, batch: List[Tuple[bytes, ChunkMeta, memoryview]], encoded: "asyncio.Future[None]"
    ) -> int:
        """The body of ``put_many``, run as a tier task; returns the batch's sequence. Its keys are
        in ``_writing`` from the call until this task is done (``put_many`` marks them, the task's
        done callback unmarks). ``encoded`` is set once the encoders no longer read the batch."""
        keys = [key for key, _, _ in batch]
        try:
            codec = self._codec
            # Encoding always leaves the loop: zstd of even a small batch is not free.
            encoding = map_slices(
                self._ops.pool,
                lambda part: _encode_slice(part, codec),
                batch,
                [raw.nbytes for _, _, raw in batch],
                workers=self._ops.io_threads,
                min_slice_bytes=MIN_SLICE_BYTES,
            )
            records: List[bytes] = await asyncio.wrap_future(encoding)
        finally:
            if not encoded.done():
                encoded.set_result(None)
        new_bytes = sum(len(r) for r in records)
        if self._index.capacity is not None and new_bytes > self._index.capacity:
            self._index.stats["errors"] += 1
            raise TierFullError(
                f"file tier: a batch of {new_bytes} encoded bytes exceeds the capacity of "
                f"{self._index.capacity} bytes"
            )
        try:
            reservation = await self._admit(keys, new_bytes)
            try:
                sequence = await self._write_batch(list(zip(keys, records)))
            finally:
                self._index.reserved -= reservation
        except TierIOError as exc:
            self._index.stats["errors"] += 1
            # "Degraded" means the filesystem failed us; a capacity refusal says nothing about it.
            self._index.degraded = isinstance(exc.__cause__, OSError)
            raise
        self._index.degraded = False
        self._index.stats["puts"] += len(batch)
        self._index.stats["put_batches"] += 1
        return sequence

    async def _admit(self, keys: Sequence[bytes], new_bytes: int) -> int:
        """Reserve room for a batch, evicting LRU records first; returns the reservation."""
        replaced = sum(self._index.lru.get(k, 0) for k in keys)
        growth = max(0, new_bytes - replaced)
        if self._index.capacity is not None:
            excess = self._index.lru.total_bytes + self._index.reserved + growth - self._index.capacity
            if excess > 0:
                victims = self._index.pick_victims(excess)
                # Reserve before awaiting, so a concurrent batch sees the room as taken.
                self._index.reserved += growth
                try:
                    await self.remove_files(victims)
                except BaseException:
                    self._index.reserved -= growth
                    raise
                return growth
        self._index.reserved += growth
        return growth

    async def remove_files(self, victims: Sequence[Tuple[bytes, int]]) -> None:
        """Unlink records already dropped from the index. A failure leaves an orphan file that the
        next open indexes again (still a valid record), so it is counted, not raised."""
        outcomes = await asyncio.gather(
            *(self._ops.remove(str(self._ops.path_for(key))) for key, _ in victims),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, FileNotFoundError):
                continue
            if isinstance(outcome, OSError):
                self._index.stats["errors"] += 1
            elif isinstance(outcome, BaseException):
                raise outcome

    async def _write_batch(self, entries: Sequence[Tuple[bytes, bytes]]) -> int:
        """Phase 1 writes and fsyncs every temp file; only when all succeeded, phase 2 renames them
        and fsyncs their directories. A full disk (the usual failure) thus fails in phase 1, before
        any reader could see a record of the batch. Returns the batch's sequence."""
        try:
            await self._ops.ensure_dirs(key_location(key)[0] for key, _ in entries)
        except OSError as exc:
            raise map_os_error(exc, "creating directories") from exc
        temps = [self._ops.temp_path(key) for key, _ in entries]
        finals = [str(self._ops.path_for(key)) for key, _ in entries]
        renamed: List[int] = []
        try:
            outcomes = await asyncio.gather(
                *(self._ops.write_temp(tmp, rec) for tmp, (_, rec) in zip(temps, entries)),
                return_exceptions=True,
            )
            for (key, _), o in zip(entries, outcomes):
                if isinstance(o, FileNotFoundError):
                    # The leaf directory was removed from outside: recreate it on the next put.
                    self._ops.dirs.discard(key_location(key)[0])
            self._raise_first(outcomes, "writing records")
            outcomes = await asyncio.gather(
                *(self._ops.replace(t, f) for t, f in zip(temps, finals)),
                return_exceptions=True,
            )
            renamed = [i for i, o in enumerate(outcomes) if o is None]
            self._raise_first(outcomes, "renaming records")
            leaf_dirs = dict.fromkeys(os.path.dirname(f) for f in finals)
            outcomes = await asyncio.gather(
                *(self._ops.sync_dir(d) for d in leaf_dirs),
                return_exceptions=True,
            )
            self._raise_first(outcomes, "syncing directories")
        except BaseException:
            await self._rollback(entries, temps, finals, renamed)
            raise
        for key, rec in entries:
            self._index.lru.put(key, len(rec))
        return self._index.next_sequence()

    @staticmethod
    def _raise_first(outcomes: Sequence[Any], what: str) -> None:
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if not errors:
            return
        # Prefer "full" as the reason: it is the one the caller can act on (free space, retry).
        for exc in errors:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise map_os_error(exc, what) from exc
        for exc in errors:
            if isinstance(exc, OSError):
                raise map_os_error(exc, what) from exc
        raise errors[0]

    async def _rollback(
        self,
        entries: Sequence[Tuple[bytes, bytes]],
        temps: Sequence[str],
        finals: Sequence[str],
        renamed: Sequence[int],
    ) -> None:
        """Undo a failed batch: remove its renamed records and its temp files. Shielded from
        cancellation so the undo itself is not cut short; what still escapes is a temp file or an
        orphan record, both handled by the next open."""
        self._index.drop([entries[i][0] for i in renamed], "deleted")  # their old files were replaced: gone
        done = set(renamed)
        doomed = [finals[i] for i in renamed] + [t for i, t in enumerate(temps) if i not in done]

        async def undo() -> None:
            await asyncio.gather(
                *(self._ops.remove(p) for p in doomed),
                return_exceptions=True,
            )

        if await wait_through_cancel(undo()):
            raise asyncio.CancelledError
