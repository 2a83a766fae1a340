"""What the fault suite's children and their parents share: deterministic chunks, the check of a
directory holding them, one-line output, starting a child and reading its lines.

Chunk content is a function of the key alone (``chunk_content``): the key spells seed, batch, index
in batch, batch size and length, so any record found on disk can be checked without a manifest, and
"every batch present is complete" can be checked from the keys (``check_cache``). A child writes
each output line with one ``os.write`` (``emit``: atomic for a pipe below PIPE_BUF), so a SIGKILL
never leaves a half line that parses; ``run_child`` starts a child module with its stderr in a file
and ``read_line`` reads its next line, bounded in time.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from kvtier.tiers.base import ChunkMeta

if TYPE_CHECKING:
    import subprocess

__all__ = [
    "FINGERPRINT",
    "KeyInfo",
    "chunk_key",
    "parse_key",
    "chunk_content",
    "chunk_meta",
    "make_batch",
    "emit",
    "check_cache",
    "CacheCheck",
    "run_child",
    "read_line",
    "run_command",
]

_KEY_MAGIC = b"KVFT"
_KEY = struct.Struct("<4sIIHHI")  # magic, seed, batch, index, batch size, length: 20 bytes
_KEY_BYTES = 32
FINGERPRINT = b"kvtier-fault-suite"


@dataclass(frozen=True)
class KeyInfo:
    seed: int
    batch: int
    index: int
    batch_size: int
    nbytes: int


def chunk_key(seed: int, batch: int, index: int, batch_size: int, nbytes: int) -> bytes:
    """A 32-byte key that spells the chunk's identity; the last 12 bytes are a hash of the first 20
    (so a key with a flipped byte is recognisably not one of ours)."""
    head = _KEY.pack(_KEY_MAGIC, seed, batch, index, batch_size, nbytes)
    return head + hashlib.blake2b(head, digest_size=_KEY_BYTES - _KEY.size).digest()


def parse_key(key: bytes) -> Optional[KeyInfo]:
    """The identity a key spells, or ``None`` for a key that is not a well-formed fault-suite key."""
    if len(key) != _KEY_BYTES:
        return None
    head = bytes(key[: _KEY.size])
    if hashlib.blake2b(head, digest_size=_KEY_BYTES - _KEY.size).digest() != bytes(key[_KEY.size :]):
        return None
    magic, seed, batch, index, batch_size, nbytes = _KEY.unpack(head)
    if magic != _KEY_MAGIC or not index < batch_size:
        return None
    return KeyInfo(seed, batch, index, batch_size, nbytes)


def chunk_content(key: bytes) -> bytes:
    """The bytes stored under ``key``: its identity (batch id first), then seeded noise; even
    indices are low-entropy (the zstd byte-plane codec keeps them), odd ones incompressible (raw)."""
    info = parse_key(key)
    if info is None:
        raise ValueError(f"not a fault-suite key: {bytes(key).hex()}")
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    noise = np.random.default_rng(seed).integers(0, 256, size=info.nbytes, dtype=np.uint8)
    if info.index % 2 == 0:
        noise &= 0x0F
    out = bytearray(noise.tobytes())
    ident = _KEY.pack(_KEY_MAGIC, info.seed, info.batch, info.index, info.batch_size, info.nbytes)
    n = min(len(ident), len(out))
    out[:n] = ident[:n]
    return bytes(out)


def chunk_meta(key: bytes) -> ChunkMeta:
    info = parse_key(key)
    assert info is not None
    return ChunkMeta(FINGERPRINT, 0, info.batch * 65536 + info.index, "uint8", (info.nbytes,))


def make_batch(seed: int, batch: int, sizes: Sequence[int]) -> List[Tuple[bytes, ChunkMeta, memoryview]]:
    """The put items of one batch: ``len(sizes)`` chunks of the given lengths."""
    items = []
    for index, nbytes in enumerate(sizes):
        key = chunk_key(seed, batch, index, len(sizes), nbytes)
        items.append((key, chunk_meta(key), memoryview(chunk_content(key))))
    return items


def emit(line: str) -> None:
    """One output line, written with one ``os.write``."""
    os.write(1, (line + "\n").encode())


@dataclass
class CacheCheck:
    """What ``check_cache`` found in a cache directory."""

    records: int = 0
    intact: int = 0
    batches: int = 0
    complete_batches: int = 0
    foreign_keys: int = 0
    problems: List[str] = field(default_factory=list)
    keys: Set[bytes] = field(default_factory=set)


def check_cache(path: str, acked: Iterable[bytes] = (), *, readonly: bool = False) -> CacheCheck:
    """Open the LMDB tier at ``path`` (blocking) and check: the tier verifies clean, its index
    agrees with its tables, every record decodes to ``chunk_content(key)``, every batch present is
    complete, and every key in ``acked`` is present. Problems are listed, not raised."""
    from kvtier.tiers.lmdb import LmdbTier

    out = CacheCheck()
    # verify_structure: the LMDB file itself must be sound after whatever happened to its writer.
    with LmdbTier(path, readonly=readonly, map_size_bytes=1 << 20, verify_structure=True) as tier:
        report = tier.verify(quarantine=False)
        for key, reason in report.corrupt:
            out.problems.append(f"verify: corrupt record {key.hex()}: {reason}")
        keys = [info.key for info in tier.iter_records()]
        out.records = len(keys)
        out.keys = set(keys)
        ours = []
        for key in keys:
            if parse_key(key) is None:
                out.foreign_keys += 1
                out.problems.append(f"a key no writer wrote: {key.hex()}")
            else:
                ours.append(key)

        async def read_all() -> List[Tuple[bytes, Optional[ChunkMeta], bytearray]]:
            if not readonly:  # the tier's LRU index agrees with its tables
                out.problems.extend(f"index: {p}" for p in await tier.check())
            found: List[Tuple[bytes, Optional[ChunkMeta], bytearray]] = []
            for i in range(0, len(ours), 64):
                part = ours[i : i + 64]
                bufs = [bytearray(parse_key(k).nbytes) for k in part]  # type: ignore[union-attr]
                metas = await tier.get_many_into([(k, memoryview(b)) for k, b in zip(part, bufs)])
                found.extend(zip(part, metas, bufs))
            return found

        by_batch: Dict[Tuple[int, int], Set[int]] = {}
        sizes: Dict[Tuple[int, int], int] = {}
        for key, meta, buf in asyncio.run(read_all()):
            info = parse_key(key)
            assert info is not None
            if meta is None:
                out.problems.append(f"record {key.hex()} listed but unreadable")
            elif bytes(buf) != chunk_content(key) or meta != chunk_meta(key):
                out.problems.append(f"record {key.hex()} holds wrong bytes")
            else:
                out.intact += 1
            bid = (info.seed, info.batch)
            by_batch.setdefault(bid, set()).add(info.index)
            sizes[bid] = info.batch_size
        out.batches = len(by_batch)
        for bid, present in by_batch.items():
            if len(present) == sizes[bid]:
                out.complete_batches += 1
            else:
                out.problems.append(f"batch {bid} half visible: {len(present)} of {sizes[bid]} chunks")
    for key in acked:
        if key not in out.keys:
            out.problems.append(f"acknowledged chunk {key.hex()} lost")
    return out


def run_child(args: Sequence[str], stderr_path: Path, module: str = "kvtier.tools.testing.fault_child") -> "subprocess.Popen[bytes]":
    """Start ``python -m MODULE ARGS`` (a fault-suite child) with stdout piped and stderr to a file."""
    import subprocess

    with open(stderr_path, "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )


def read_line(proc: "subprocess.Popen[bytes]", timeout_s: float) -> str:
    """The child's next stdout line; ``TimeoutError`` after ``timeout_s``, ``EOFError`` at its end."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"no line from the child within {timeout_s} s")
    line = proc.stdout.readline()
    if not line:
        raise EOFError("the child closed its stdout")
    return line.decode().rstrip("\n")


def run_command(commands: Mapping[str, Callable[[Any], Any]], args: Any) -> int:
    """A child's ``main``: ``commands[args.command](args)``, run to completion with ``asyncio.run``
    when it is a coroutine; 0."""
    result = commands[args.command](args)
    if asyncio.iscoroutine(result):
        asyncio.run(result)
    return 0
