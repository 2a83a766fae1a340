"""The structure check at open walks a file only when it changed since a verified, clean close: an
unchanged file opens without the walk (which reads all of it), and any write to it since (damage
written in place, even with its modification time put back) is walked and refused."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from pathlib import Path
from typing import List

import pytest

from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import CorruptCacheError, LmdbTier
from kvtier.tiers.lmdb.recovery import VERIFIED_STAMP
from kvtier.tools.testing.corrupt_child import flip_bytes

lmdb_verify = pytest.importorskip("lmdb.verify")


@pytest.fixture
def walks(monkeypatch) -> List[str]:
    """The directories py-lmdb's offline verifier walks (the real verifier runs)."""
    seen: List[str] = []
    real = lmdb_verify.verify

    def counted(path: str, *args, **kwargs):
        seen.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(lmdb_verify, "verify", counted)
    return seen


def filled(path: Path, verify: bool = True) -> None:
    meta = ChunkMeta(b"stamp", 0, 0, "uint8", (512,))
    with LmdbTier(path, verify_structure=verify, segment_threshold_bytes=None) as tier:
        asyncio.run(tier.put_many([(os.urandom(32), meta, memoryview(os.urandom(512))) for _ in range(300)]))


def test_an_unchanged_file_opens_without_the_walk_and_a_changed_one_is_walked(tmp_path: Path, walks) -> None:
    cache = tmp_path / "kv"
    filled(cache)
    assert (cache / VERIFIED_STAMP).exists() and walks == []  # a new environment: sound as made
    with LmdbTier(cache, verify_structure=True, readonly=True):
        pass
    assert walks == []  # unchanged since the verified close: not walked
    with LmdbTier(cache, verify_structure=True) as tier:
        assert walks == [] and tier.statistics().records == 300
    os.utime(cache / "data.mdb")  # touched since (any write does): walked
    with LmdbTier(cache, verify_structure=True):
        assert walks == [str(cache)]


def test_damage_written_in_place_after_the_stamp_is_walked_and_refused(tmp_path: Path, walks) -> None:
    cache = tmp_path / "kv"
    filled(cache)
    pristine = (cache / "data.mdb").read_bytes()
    for seed in range(200):  # flips the verifier catches (some land where nothing reads)
        probe = tmp_path / f"probe-{seed}"
        probe.mkdir()
        shutil.copyfile(cache / "data.mdb", probe / "data.mdb")
        flip_bytes(probe / "data.mdb", random.Random(seed), 8, "structure")
        if lmdb_verify.verify(str(probe)):
            break
    else:
        raise AssertionError("no structural damage in 200 tries")
    before = os.stat(cache / "data.mdb")
    with open(cache / "data.mdb", "r+b") as f:  # in place: same inode, same size
        f.write((probe / "data.mdb").read_bytes())
    os.utime(cache / "data.mdb", ns=(before.st_atime_ns, before.st_mtime_ns))  # its time put back
    assert (cache / "data.mdb").read_bytes() != pristine
    walked = len(walks)
    with pytest.raises(CorruptCacheError, match="is damaged"):
        LmdbTier(cache, verify_structure=True)
    assert len(walks) == walked + 1


def test_a_file_opened_unverified_is_never_stamped(tmp_path: Path, walks) -> None:
    cache = tmp_path / "kv"
    filled(cache, verify=False)
    assert not (cache / VERIFIED_STAMP).exists()
    with LmdbTier(cache, verify_structure=True):
        pass
    assert walks == [str(cache)] and (cache / VERIFIED_STAMP).exists()
