"""Opening a cache directory at its edges: a full disk without ``lock.mdb`` is one line
(TierFullError), not SIGBUS, and leaves the directory as it was; a map another process grew while
we opened is adopted; quarantine moves only kvtier's files and works on a mount point; another
program's LMDB is refused, not written into; a read-only inspect writes nothing.

What could crash (SIGBUS) runs in a child process; the rest through ``main()`` and the public API.
Mounts are real (tmpfs, bind), root only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.errors import TierIOError
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tools.cli import main
from kvtier.tools._maintenance import gc_cache, verify_cache
from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT as LAYOUT
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device
from mounts import bind_mount, fill_up, tmpfs

FINGERPRINT = b"lmdb-open-edges"


def config(cache: Path, **changes) -> EngineConfig:
    return EngineConfig(cache_dir=str(cache), host_capacity_bytes=1 << 20, lmdb_map_size_bytes=1 << 20,
                        pressure_poll_interval_s=3600.0, **changes)


async def fill_cache(cache: Path, prompts: int = 2) -> None:
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=FINGERPRINT) as engine:
        scenario = OffloadScenario(engine)
        for _ in range(prompts):
            await scenario.produce(scenario.tokens(40))


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("open-edges") / "cache"
    asyncio.run(fill_cache(cache))
    return cache


def listing(directory: Path):
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else None


# The commands, each in this child, one after the other: a SIGBUS kills the child, not pytest.
_DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from kvtier.tools.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        results.append([code, err.getvalue()])
        print(json.dumps(results[-1]), flush=True)
    """
)


def test_a_full_disk_without_lock_file_is_one_line_and_leaves_the_directory_as_it_was(small_cache, tmp_path):
    with tmpfs(tmp_path / "full", "size=512k,mode=0700") as full:
        copied = full / "copied"
        copied.mkdir(mode=0o700)
        shutil.copy(small_cache / "data.mdb", copied / "data.mdb")  # a copied data.mdb: no lock.mdb
        fill_up(full / "filler")
        cases = [
            ["demo", "--cache-dir", str(full / "new"), "--producers", "1"],  # the engine's start
            ["verify", "--cache-dir", str(copied)],
            ["gc", "--cache-dir", str(copied), "--max-bytes", "0"],
            ["inspect", "--cache-dir", str(copied), "--json"],  # read-only: needs no lock file
        ]
        proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"the child died with {proc.returncode}: {proc.stderr[-2000:]}"
        results = [json.loads(line) for line in proc.stdout.splitlines()]
        for (code, err), argv in zip(results[:3], cases):
            lines = [line for line in err.splitlines() if "WARNING" not in line]
            assert code == 2 and len(lines) == 1, (argv, err)
            assert lines[0].startswith("kvtier: error: no space left on the device of "), lines[0]
        assert results[3][0] == 0, results[3]
        assert listing(full / "new") is None  # the directory the demo would have made is not there
        assert listing(copied) == ["data.mdb"]


def test_a_read_only_inspect_writes_no_data_only_lmdbs_lock_file(small_cache, tmp_path, capsys):
    copied = tmp_path / "copied"
    copied.mkdir(mode=0o700)
    shutil.copy(small_cache / "data.mdb", copied / "data.mdb")
    before = (copied / "data.mdb").read_bytes()
    assert main(["inspect", "--cache-dir", str(copied), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] > 0
    assert main(["verify", "--cache-dir", str(copied), "--no-quarantine"]) == 0
    # lock.mdb holds LMDB's reader slots (so a writer opening later cannot reuse pages these reads
    # use), no cache data; nothing else appears and data.mdb is unchanged.
    assert listing(copied) == ["data.mdb", "lock.mdb"]
    assert (copied / "lock.mdb").stat().st_mode & 0o777 == 0o600
    assert (copied / "data.mdb").read_bytes() == before


def test_a_read_only_inspect_works_on_a_read_only_mount_and_writes_nothing(small_cache, tmp_path, capsys):
    source = tmp_path / "source"
    source.mkdir(mode=0o700)
    shutil.copy(small_cache / "data.mdb", source / "data.mdb")  # no lock.mdb, and none can be made
    before = (source / "data.mdb").read_bytes()
    with bind_mount(source, tmp_path / "ro", read_only=True) as ro:
        assert main(["inspect", "--cache-dir", str(ro), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["records"] > 0
        assert main(["verify", "--cache-dir", str(ro), "--no-quarantine"]) == 0
        assert "20 records checked, 20 ok" in capsys.readouterr().out
    assert listing(source) == ["data.mdb"]
    assert (source / "data.mdb").read_bytes() == before


def without_write_permission_override(argv):
    """``argv`` as this user without CAP_DAC_OVERRIDE: as root, too, a directory's mode bits then
    hold (a directory the owner made 0500 refuses new files)."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root's permission override")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps, "--", *argv]


def test_a_read_only_inspect_works_in_a_directory_it_may_not_write(small_cache, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    shutil.copy(small_cache / "data.mdb", locked / "data.mdb")
    before = (locked / "data.mdb").read_bytes()
    locked.chmod(0o500)  # its owner may read it, not create lock.mdb in it
    try:
        cases = [["inspect", "--cache-dir", str(locked), "--json"],
                 ["verify", "--cache-dir", str(locked), "--no-quarantine"]]
        proc = subprocess.run(without_write_permission_override([sys.executable, "-c", _DRIVER, json.dumps(cases)]),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"the child died with {proc.returncode}: {proc.stderr[-2000:]}"
        results = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [code for code, _ in results] == [0, 0], results
    finally:
        locked.chmod(0o700)
    assert listing(locked) == ["data.mdb"]
    assert (locked / "data.mdb").read_bytes() == before


def test_another_programs_lmdb_is_refused_and_left_alone(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    env = lmdb.open(str(other), max_dbs=2, map_size=1 << 20)
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"1", db=users)
    env.close()
    before = (other / "data.mdb").read_bytes()
    for argv in (["verify", "--cache-dir", str(other)], ["gc", "--cache-dir", str(other), "--max-bytes", "0"],
                 ["demo", "--cache-dir", str(other), "--producers", "1"], ["inspect", "--cache-dir", str(other)]):
        assert main(argv) == 2, argv
        err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
        assert len(err) == 1 and "holds an LMDB environment kvtier did not create (users)" in err[0], (argv, err)
    assert (other / "data.mdb").read_bytes() == before
    with pytest.raises(TierIOError, match="kvtier did not create"):
        LmdbTier(other, map_size_bytes=1 << 20)


_GROW = textwrap.dedent(
    """
    import sys, lmdb
    env = lmdb.open(sys.argv[1], max_dbs=4, map_size=64 << 20)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True) as txn:  # grow the file past the opener's 1 MiB map...
        txn.put(b"grow", bytes(4 << 20), db=chunks)
    with env.begin(write=True) as txn:  # ...and leave the records as they were
        txn.delete(b"grow", db=chunks)
    env.close()
    """
)


def test_a_map_grown_by_another_process_while_opening_is_adopted(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    asyncio.run(fill_cache(cache, prompts=1))
    real_open = lmdb.open
    grown = []

    def open_then_grow(path, **kwargs):
        # Another process grows the map between our lmdb.open and the first transaction: the
        # window in which gc / verify / an engine's start open their tables.
        env = real_open(path, **kwargs)
        subprocess.run([sys.executable, "-c", _GROW, path], check=True, timeout=60)
        grown.append(path)
        return env

    monkeypatch.setattr(lmdb, "open", open_then_grow)
    assert verify_cache(str(cache)).ok > 0
    assert gc_cache(str(cache), 1 << 30)["evicted_records"] == 0

    async def start_and_count():
        # The whole listing before the count: on a loaded machine it can outlast the default wait.
        async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache, disk_index_wait_s=None),
                                 fingerprint=FINGERPRINT) as engine:
            return engine.statistics()["disk"]["records"]

    assert asyncio.run(start_and_count()) > 0
    assert len(grown) == 3


async def start_over_a_damaged_cache(cache: Path) -> str:
    (cache / "data.mdb").write_bytes(b"not an LMDB file " * 4096)
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=FINGERPRINT) as engine:
        scenario = OffloadScenario(engine)
        assert (await scenario.produce(scenario.tokens(40))).durable
        return engine.quarantined_cache_dir


def test_quarantine_moves_only_kvtiers_files_and_works_on_a_mount_point(tmp_path):
    # A plain directory holding someone else's file: only data.mdb and lock.mdb move aside.
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    (plain / "notes.txt").write_text("not kvtier's")
    aside = Path(asyncio.run(start_over_a_damaged_cache(plain)))
    assert aside.parent == tmp_path and aside.name.startswith("plain.corrupt-")
    assert listing(aside) == ["data.mdb", "lock.mdb"]
    assert (aside / "data.mdb").read_bytes().startswith(b"not an LMDB file")
    assert listing(plain) == [".kvtier-verified", "data.mdb", "lock.mdb", "notes.txt"]  # the fresh one, closed

    # The cache directory is a mount point (an NVMe mounted at the cache path): renaming it is
    # EBUSY; the damaged files move aside inside it.
    source = tmp_path / "nvme"
    source.mkdir(mode=0o700)
    (source / "notes.txt").write_text("not kvtier's")
    with bind_mount(source, tmp_path / "mnt") as mount:
        os.chmod(mount, 0o700)
        aside = Path(asyncio.run(start_over_a_damaged_cache(mount)))
        assert str(mount) in Path("/proc/self/mounts").read_text()  # (os.path.ismount misses bind mounts)
        assert aside.parent == mount and aside.name.startswith(".kvtier-corrupt-")
        assert listing(aside) == ["data.mdb", "lock.mdb"]
        assert (mount / "notes.txt").read_text() == "not kvtier's"
        assert verify_cache(str(mount)).ok > 0  # the fresh environment beside them works


def test_after_an_external_gc_a_load_says_missing_and_lookup_stops_admitting_within_the_refresh(tmp_path):
    cache = tmp_path / "cache"

    async def scenario():
        async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=FINGERPRINT) as engine:
            producer = OffloadScenario(engine)
            prompts = [producer.tokens(40), producer.tokens(40)]
            for prompt in prompts:
                assert (await producer.produce(prompt)).durable
        # A serving engine over the directory (its chunks on disk only), and a cron gc beside it.
        refreshed = config(cache, disk_index_refresh_interval_s=0.2)
        async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), refreshed, fingerprint=FINGERPRINT) as engine:
            consumer = OffloadScenario(engine, seed=1)
            first, second = (engine.request_keys(p + [1]) for p in prompts)
            assert engine.lookup(first) == 32 and engine.lookup(second) == 32
            gc = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "gc", "--cache-dir", str(cache),
                                 "--max-bytes", "0"], capture_output=True, text=True, timeout=120)
            assert gc.returncode == 0, gc.stderr
            # The loop was blocked meanwhile: the index has not been refreshed, lookup still admits.
            assert engine.lookup(first) == 32
            result = await engine.load(first, 32, consumer.allocate(41))
            assert (result.ok, result.reason) == (False, "missing")
            assert engine.lookup(first) == 0  # the load's finding left the index at once
            for _ in range(100):  # bounded: the refresh runs every 0.2 s
                if engine.lookup(second) == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.lookup(second) == 0
            assert engine.disk_tier.statistics().corrupt == 0

    asyncio.run(scenario())


def test_a_cache_directory_whose_parent_is_missing_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"cache_dir '.*/nvme/kvtier': its parent .*/nvme does not exist \(kvtier creates only the last"):
        OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(tmp_path / "nvme" / "kvtier"), fingerprint=FINGERPRINT)
    assert listing(tmp_path) == []


def _damage_meta(path: Path, change) -> None:
    """Open the cache's LMDB environment directly and apply ``change(txn, meta_db)``."""
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            change(txn, env.open_db(b"meta", txn=txn))
    finally:
        env.close()


@pytest.mark.parametrize("damage", ["marker gone", "marker garbled", "table name flipped"])
def test_a_kvtier_cache_with_damaged_names_or_marker_is_corrupt_not_foreign(tmp_path: Path, damage: str) -> None:
    """kvtier creates its tables and the format marker in one transaction: its own table names with
    the marker gone or garbled, or a table name a byte away from one of its own, are damage
    (CorruptCacheError: the engine moves the cache aside), not another program's database
    (TierIOError: refused, kept). A newer kvtier's marker (a larger decimal version) stays refused."""
    from kvtier.errors import CorruptCacheError

    cache = tmp_path / "c"
    with LmdbTier(cache):
        pass
    if damage == "marker gone":
        _damage_meta(cache, lambda txn, meta: txn.delete(b"format", db=meta))
    elif damage == "marker garbled":
        _damage_meta(cache, lambda txn, meta: txn.put(b"format", b"\x12", db=meta))
    else:  # a flipped bit in the main database's key 'atime' (every copy of its page): 'atimf'
        data = (cache / "data.mdb").read_bytes()
        assert b"atime" in data
        (cache / "data.mdb").write_bytes(data.replace(b"atime", b"atimf"))
    with pytest.raises(CorruptCacheError, match="damaged"):
        LmdbTier(cache)


def test_a_newer_format_marker_is_refused_not_moved_aside(tmp_path: Path) -> None:
    from kvtier.errors import CorruptCacheError

    cache = tmp_path / "c"
    with LmdbTier(cache):
        pass
    _damage_meta(cache, lambda txn, meta: txn.put(b"format", b"9", db=meta))
    with pytest.raises(TierIOError, match="has tier format b'9'") as info:
        LmdbTier(cache)
    assert not isinstance(info.value, CorruptCacheError)


def test_open_tables_read_only_without_a_format_marker_is_corrupt(tmp_path: Path) -> None:
    """``open_tables`` itself (not only the foreign-environment check before it) calls a read-only
    cache whose marker is gone damage, with its message, rather than failing on the missing value."""
    from kvtier.errors import CorruptCacheError
    from kvtier.tiers.lmdb.tables import open_tables

    cache = tmp_path / "c"
    with LmdbTier(cache):
        pass
    _damage_meta(cache, lambda txn, meta: txn.delete(b"format", db=meta))
    env = lmdb.open(str(cache), max_dbs=8, readonly=True, lock=False)
    try:
        with pytest.raises(CorruptCacheError, match=r"/c has kvtier's LMDB tables but its format marker is gone \(damaged\)"):
            open_tables(env, cache, readonly=True)
    finally:
        env.close()
