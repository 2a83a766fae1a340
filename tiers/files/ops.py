"""The file tier's file operations: its I/O pool and every blocking call it makes, each behind the
fault-injection hook.

``FileOps`` is called on the event-loop thread; each operation runs on the tier's own
``ThreadPoolExecutor`` (``kvtier-files-*``, ``io_threads`` workers; aiofiles is handed it), so the
loop never blocks. ``io_hook`` (a ``tiers.base.IOHook``) is called right before every mkdir, open,
write, fsync, rename, directory fsync, read and remove (``_make_dirs`` on its I/O thread); the fault
suite makes it raise ``OSError`` as the real call would. The set of record directories known to
exist, and the creations in flight, are loop-only state.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Sequence, Set, Tuple

import aiofiles
import aiofiles.os

from ..base import NO_IO_HOOK, IOHook, check_key
from ..codec_pool import MIN_SLICE_BYTES, map_slices, wait_threads
from .layout import DIR_MODE, HOST_TAG, RECORD_SUFFIX, fsync_dir, key_location, private_opener, temp_name

__all__ = ["FileOps"]

# Below this many raw bytes in a whole get batch, decoding on the loop is cheaper than a hop.
_INLINE_DECODE_BYTES = 256 << 10


class FileOps:
    """The I/O pool and the file operations of one root (called on the event-loop thread; see the
    module docstring)."""

    def __init__(self, root: Path, io_threads: int) -> None:
        self.root = root
        self.io_threads = io_threads
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-files")
        self.loop = asyncio.get_running_loop()
        self.io_hook: IOHook = NO_IO_HOOK
        self.dirs: Set[Tuple[str, ...]] = set()  # record directories known to exist
        self._dir_pending: Dict[Tuple[str, ...], "asyncio.Future[None]"] = {}
        # Temp names carry host and pid so that open() can tell a dead writer's leftovers apart.
        self._temp_tag = f"{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}"
        self._temp_seq = count()

    def path_for(self, key: bytes) -> Path:
        """Where ``key``'s record lives (whether or not it exists). Any thread."""
        dirs, name = key_location(check_key(key))
        return self.root.joinpath(*dirs, name + RECORD_SUFFIX)

    def temp_path(self, key: bytes) -> str:
        dirs, _ = key_location(key)
        return os.path.join(self.root, *dirs, temp_name(key, f"{self._temp_tag}{next(self._temp_seq):x}"))

    async def run_codec(self, fn: Callable[[List[Any]], List[Any]], jobs: Sequence[Any], sizes: Sequence[int],
                        *, inline_below: int = 0) -> List[Any]:
        """``fn`` over ``jobs``: on the loop when their ``sizes`` sum below ``inline_below`` (a hop
        would cost more), else in slices on the I/O threads (``tiers.codec_pool``; the buffer rule
        when cancelled: running slices finish, unstarted ones are abandoned)."""
        if not jobs:
            return []
        if sum(sizes) < inline_below:
            return fn(list(jobs))
        work = map_slices(self.pool, fn, jobs, sizes, workers=self.io_threads, min_slice_bytes=MIN_SLICE_BYTES)
        return await wait_threads(work, abandon_unstarted=True)

    async def decode(self, fn: Callable[[List[Any]], List[Any]], jobs: Sequence[Any], sizes: Sequence[int]) -> List[Any]:
        """Decode a get batch with ``fn`` (``run_codec``, on the loop under ``_INLINE_DECODE_BYTES``)."""
        return await self.run_codec(fn, jobs, sizes, inline_below=_INLINE_DECODE_BYTES)

    async def ensure_dirs(self, dirs: Iterable[Tuple[str, ...]]) -> None:
        """Create missing record directories, one hop per batch. Single-flight per directory: a
        second batch needing the same directory waits for the first one's parent fsync instead of
        renaming into a directory whose own entry may not be durable yet."""
        missing = [d for d in dict.fromkeys(dirs) if d not in self.dirs]
        if not missing:
            return
        waits = {id(f): f for f in (self._dir_pending.get(d) for d in missing) if f is not None}
        mine = [d for d in missing if d not in self._dir_pending]
        if mine:
            fut = self.loop.run_in_executor(self.pool, self._make_dirs, mine)
            for d in mine:
                self._dir_pending[d] = fut

            def settle(f: "asyncio.Future[None]", mine: List[Tuple[str, ...]] = mine) -> None:
                for d in mine:
                    self._dir_pending.pop(d, None)
                if not f.cancelled() and f.exception() is None:
                    self.dirs.update(mine)

            fut.add_done_callback(settle)
            waits[id(fut)] = fut
        # Shielded: one waiter's cancellation must not cancel the creation others wait for.
        await asyncio.gather(*(asyncio.shield(f) for f in waits.values()))

    def _make_dirs(self, dirs: Sequence[Tuple[str, ...]]) -> None:
        """Runs on an I/O thread: create record directories level by level, fsync each new entry
        into its parent so a record renamed into it cannot vanish with the directory after a
        power cut."""
        synced: Set[str] = set()
        hook = self.io_hook
        for components in dirs:
            parent = self.root
            for name in components:
                path = parent / name
                try:
                    hook.before("mkdir")
                    os.mkdir(path, DIR_MODE)
                    synced.add(str(parent))
                except FileExistsError:
                    pass
                parent = path
        for where in synced:
            hook.before("fsync_dir")
            fsync_dir(where)

    async def write_temp(self, tmp: str, record: bytes) -> None:
        # "xb" is O_CREAT|O_EXCL: a name collision (another process, a reused nonce) fails loudly
        # instead of two writers interleaving into one file.
        self.io_hook.before("open")
        async with aiofiles.open(tmp, "xb", opener=private_opener, executor=self.pool) as f:
            self.io_hook.before("write")
            await f.write(record)
            await f.flush()
            self.io_hook.before("fsync")
            await self.loop.run_in_executor(self.pool, os.fsync, f.fileno())

    async def read(self, path: Path, limit: int) -> bytes:
        """At most ``limit`` bytes of the file at ``path`` (``OSError`` as the read raises it)."""
        self.io_hook.before("read")
        async with aiofiles.open(path, "rb", executor=self.pool) as f:
            return await f.read(limit)

    async def replace(self, src: str, dst: str) -> None:
        self.io_hook.before("rename")
        await aiofiles.os.replace(src, dst, executor=self.pool)

    async def remove(self, path: str) -> None:
        self.io_hook.before("remove")
        await aiofiles.os.remove(path, executor=self.pool)

    async def sync_dir(self, path: str) -> None:
        self.io_hook.before("fsync_dir")
        await self.loop.run_in_executor(self.pool, fsync_dir, path)
