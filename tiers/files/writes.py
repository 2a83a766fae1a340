"""The file tier's write side: a put batch from encoding to durable renames, eviction for room,
and the file operations under them.

Runs on the event-loop thread (the index, reservations and the set of keys being written are
loop-only state); every blocking call goes to the tier's I/O pool (aiofiles is handed it). A batch
writes and fsyncs every temp file first, and only when all succeeded renames them and fsyncs their
directories, so a full disk fails the batch before any reader could see a record of it; a failure
after a rename removes what the batch renamed (``_rollback``).

``FileWrites`` is a mixin of ``FileTier``: it uses the index, counters, I/O pool and removal
reporting that ``FileTier.__init__`` sets up (declared below for readers and type checkers).
"""

from __future__ import annotations

import asyncio
import errno
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import aiofiles
import aiofiles.os

from kvtier.errors import TierFullError, TierIOError

from ..base import ChunkMeta, IOHook
from ..codec_pool import MIN_SLICE_BYTES, map_slices, wait_through_cancel
from ..key_counts import KeyCounts
from ..lru import ByteLru
from ..record_format import CodecConfig, encode_record
from .layout import DIR_MODE, fsync_dir, key_location, private_opener, temp_name

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
    """The write path of ``FileTier``; see the module docstring."""

    _root: Path
    _capacity: Optional[int]
    _codec: CodecConfig
    _io: ThreadPoolExecutor
    _io_threads: int
    _loop: asyncio.AbstractEventLoop
    _index: ByteLru
    _reserved: int  # net growth of admitted batches not landed yet
    _writing: KeyCounts  # keys with a write in flight: never evicted
    _dirs: Set[Tuple[str, ...]]
    _dir_pending: Dict[Tuple[str, ...], "asyncio.Future[None]"]
    _temp_tag: str
    _io_hook: IOHook
    _stats: Dict[str, int]
    _degraded: bool

    def _next_sequence(self) -> int:
        raise NotImplementedError  # FileTier's

    def _drop(self, keys: Sequence[bytes], reason: str) -> List[Tuple[bytes, int]]:
        raise NotImplementedError  # FileTier's

    def path_for(self, key: bytes) -> Path:
        raise NotImplementedError  # FileTier's

    async def _put_batch(
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
                self._io,
                lambda part: _encode_slice(part, codec),
                batch,
                [raw.nbytes for _, _, raw in batch],
                workers=self._io_threads,
                min_slice_bytes=MIN_SLICE_BYTES,
            )
            records: List[bytes] = await asyncio.wrap_future(encoding)
        finally:
            if not encoded.done():
                encoded.set_result(None)
        new_bytes = sum(len(r) for r in records)
        if self._capacity is not None and new_bytes > self._capacity:
            self._stats["errors"] += 1
            raise TierFullError(
                f"file tier: a batch of {new_bytes} encoded bytes exceeds the capacity of "
                f"{self._capacity} bytes"
            )
        try:
            reservation = await self._admit(keys, new_bytes)
            try:
                sequence = await self._write_batch(list(zip(keys, records)))
            finally:
                self._reserved -= reservation
        except TierIOError as exc:
            self._stats["errors"] += 1
            # "Degraded" means the filesystem failed us; a capacity refusal says nothing about it.
            self._degraded = isinstance(exc.__cause__, OSError)
            raise
        self._degraded = False
        self._stats["puts"] += len(batch)
        self._stats["put_batches"] += 1
        return sequence

    async def _admit(self, keys: Sequence[bytes], new_bytes: int) -> int:
        """Reserve room for a batch, evicting LRU records first; returns the reservation."""
        replaced = sum(self._index.get(k, 0) for k in keys)
        growth = max(0, new_bytes - replaced)
        if self._capacity is not None:
            excess = self._index.total_bytes + self._reserved + growth - self._capacity
            if excess > 0:
                victims = self._pick_victims(excess)
                # Reserve before awaiting, so a concurrent batch sees the room as taken.
                self._reserved += growth
                try:
                    await self._remove_files(victims)
                except BaseException:
                    self._reserved -= growth
                    raise
                return growth
        self._reserved += growth
        return growth

    def _pick_victims(self, excess: int) -> List[Tuple[bytes, int]]:
        """Drop least-recently-used records (not being written) from the index until ``excess``
        bytes are freed, reported as evicted; all or nothing: raises ``TierFullError`` and changes
        nothing otherwise."""
        chosen = self._index.choose_victims(excess, keep=self._writing)
        if chosen is None:
            raise TierFullError(
                f"file tier: cannot free {excess} bytes under the capacity of {self._capacity} "
                "bytes: the rest is being written"
            )
        victims = self._drop([key for key, _ in chosen], "evicted")
        self._stats["evictions"] += len(victims)
        return victims

    async def _remove_files(self, victims: Sequence[Tuple[bytes, int]]) -> None:
        """Unlink records already dropped from the index. A failure leaves an orphan file that the
        next open indexes again (still a valid record), so it is counted, not raised."""
        outcomes = await asyncio.gather(
            *(self._remove(str(self.path_for(key))) for key, _ in victims),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, FileNotFoundError):
                continue
            if isinstance(outcome, OSError):
                self._stats["errors"] += 1
            elif isinstance(outcome, BaseException):
                raise outcome

    async def _ensure_dirs(self, dirs: Iterable[Tuple[str, ...]]) -> None:
        """Create missing record directories, one hop per batch. Single-flight per directory: a
        second batch needing the same directory waits for the first one's parent fsync instead of
        renaming into a directory whose own entry may not be durable yet."""
        missing = [d for d in dict.fromkeys(dirs) if d not in self._dirs]
        if not missing:
            return
        waits = {id(f): f for f in (self._dir_pending.get(d) for d in missing) if f is not None}
        mine = [d for d in missing if d not in self._dir_pending]
        if mine:
            fut = self._loop.run_in_executor(self._io, self._make_dirs, mine)
            for d in mine:
                self._dir_pending[d] = fut

            def settle(f: "asyncio.Future[None]", mine: List[Tuple[str, ...]] = mine) -> None:
                for d in mine:
                    self._dir_pending.pop(d, None)
                if not f.cancelled() and f.exception() is None:
                    self._dirs.update(mine)

            fut.add_done_callback(settle)
            waits[id(fut)] = fut
        # Shielded: one waiter's cancellation must not cancel the creation others wait for.
        await asyncio.gather(*(asyncio.shield(f) for f in waits.values()))

    def _make_dirs(self, dirs: Sequence[Tuple[str, ...]]) -> None:
        """Runs on an I/O thread: create record directories level by level, fsync each new entry
        into its parent so a record renamed into it cannot vanish with the directory after a
        power cut."""
        synced: Set[str] = set()
        hook = self._io_hook
        for components in dirs:
            parent = self._root
            for name in components:
                path = parent / name
                try:
                    hook.before("mkdir")
                    os.mkdir(path, DIR_MODE)
                    synced.add(str(parent))
                except FileExistsError:
                    pass
                parent = path
        for path in synced:
            hook.before("fsync_dir")
            fsync_dir(path)

    def _temp_path(self, key: bytes) -> str:
        dirs, _ = key_location(key)
        return os.path.join(self._root, *dirs, temp_name(key, f"{self._temp_tag}{next(self._temp_seq):x}"))

    async def _write_temp(self, tmp: str, record: bytes) -> None:
        # "xb" is O_CREAT|O_EXCL: a name collision (another process, a reused nonce) fails loudly
        # instead of two writers interleaving into one file.
        self._io_hook.before("open")
        async with aiofiles.open(tmp, "xb", opener=private_opener, executor=self._io) as f:
            self._io_hook.before("write")
            await f.write(record)
            await f.flush()
            self._io_hook.before("fsync")
            await self._loop.run_in_executor(self._io, os.fsync, f.fileno())

    async def _replace(self, src: str, dst: str) -> None:
        self._io_hook.before("rename")
        await aiofiles.os.replace(src, dst, executor=self._io)

    async def _remove(self, path: str) -> None:
        self._io_hook.before("remove")
        await aiofiles.os.remove(path, executor=self._io)

    async def _sync_dir(self, path: str) -> None:
        self._io_hook.before("fsync_dir")
        await self._loop.run_in_executor(self._io, fsync_dir, path)

    async def _write_batch(self, entries: Sequence[Tuple[bytes, bytes]]) -> int:
        """Phase 1 writes and fsyncs every temp file; only when all succeeded, phase 2 renames them
        and fsyncs their directories. A full disk (the usual failure) thus fails in phase 1, before
        any reader could see a record of the batch. Returns the batch's sequence."""
        try:
            await self._ensure_dirs(key_location(key)[0] for key, _ in entries)
        except OSError as exc:
            raise map_os_error(exc, "creating directories") from exc
        temps = [self._temp_path(key) for key, _ in entries]
        finals = [str(self.path_for(key)) for key, _ in entries]
        renamed: List[int] = []
        try:
            outcomes = await asyncio.gather(
                *(self._write_temp(tmp, rec) for tmp, (_, rec) in zip(temps, entries)),
                return_exceptions=True,
            )
            for (key, _), o in zip(entries, outcomes):
                if isinstance(o, FileNotFoundError):
                    # The leaf directory was removed from outside: recreate it on the next put.
                    self._dirs.discard(key_location(key)[0])
            self._raise_first(outcomes, "writing records")
            outcomes = await asyncio.gather(
                *(self._replace(t, f) for t, f in zip(temps, finals)),
                return_exceptions=True,
            )
            renamed = [i for i, o in enumerate(outcomes) if o is None]
            self._raise_first(outcomes, "renaming records")
            leaf_dirs = dict.fromkeys(os.path.dirname(f) for f in finals)
            outcomes = await asyncio.gather(
                *(self._sync_dir(d) for d in leaf_dirs),
                return_exceptions=True,
            )
            self._raise_first(outcomes, "syncing directories")
        except BaseException:
            await self._rollback(entries, temps, finals, renamed)
            raise
        for key, rec in entries:
            self._index.put(key, len(rec))
        return self._next_sequence()

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
        self._drop([entries[i][0] for i in renamed], "deleted")  # their old files were replaced: gone
        done = set(renamed)
        doomed = [finals[i] for i in renamed] + [t for i, t in enumerate(temps) if i not in done]

        async def undo() -> None:
            await asyncio.gather(
                *(self._remove(p) for p in doomed),
                return_exceptions=True,
            )

        if await wait_through_cancel(undo()):
            raise asyncio.CancelledError
