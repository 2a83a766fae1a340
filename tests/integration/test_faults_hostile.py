"""Fault suite, hostile input: a pickle planted under a valid key is never executed and is a miss;
oversize or lying record headers are rejected before anything of the claimed size is allocated;
chunk keys of different tenants (salts) or models (fingerprints) never meet."""

from __future__ import annotations

import ast
import pickle
import struct
import tracemalloc
from pathlib import Path
from typing import Callable, List, Tuple

import lmdb
import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.errors import CorruptRecordError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.files import FileTier
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig, _checksum, decode_record, encode_record, validate_record
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
REPO = Path(__file__).resolve().parents[2]


class _CreatesFile:
    """Unpickling this object calls ``open(path, "w")``: the sentinel file appears."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_payload(sentinel: Path) -> bytes:
    return pickle.dumps(_CreatesFile(sentinel), protocol=pickle.HIGHEST_PROTOCOL)


def config(cache: Path) -> EngineConfig:
    # Start waits for the whole disk listing: these tests look keys up right after start, and on
    # a loaded machine the listing can take longer than the default wait (keys still misses then).
    return EngineConfig(cache_dir=str(cache), host_capacity_bytes=1, lmdb_map_size_bytes=1 << 20,
                        pressure_poll_interval_s=3600.0, disk_index_wait_s=None)


def raw_put(cache: Path, entries: List[Tuple[bytes, bytes]]) -> None:
    """Write values straight into the tier's ``chunks`` table, bypassing kvtier (no tier is open)."""
    env = lmdb.open(str(cache), max_dbs=4, subdir=True)
    try:
        db = env.open_db(b"chunks")
        with env.begin(write=True) as txn:
            for key, value in entries:
                txn.put(key, value, db=db)
    finally:
        env.close()


def raw_get(cache: Path, key: bytes) -> bytes:
    env = lmdb.open(str(cache), max_dbs=4, subdir=True, readonly=True)
    try:
        db = env.open_db(b"chunks", create=False)
        with env.begin() as txn:
            return bytes(txn.get(key, db=db))
    finally:
        env.close()


def test_the_pickle_payload_is_live(tmp_path: Path) -> None:
    # The control: unpickling the payload does create its sentinel, so "never appears" means something.
    sentinel = tmp_path / "control"
    pickle.loads(pickle_payload(sentinel))
    assert sentinel.exists()


@pytest.mark.asyncio
async def test_a_pickle_under_a_valid_key_is_a_miss_and_never_runs(tmp_path: Path) -> None:
    cache, sentinel = tmp_path / "cache", tmp_path / "sentinel"
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"m") as engine:
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt)
        keys = engine.request_keys(prompt)
    payload = pickle_payload(sentinel)
    # Every stored chunk of the prompt now holds the bare pickle.
    stored = [k for group in keys.keys for k in group]
    raw_put(cache, [(k, payload) for k in stored])

    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"m") as engine:
        scenario = OffloadScenario(engine)
        assert engine.lookup(prompt + [1]) == 32  # the keys are there...
        result = await engine.load(prompt + [1], 32, scenario.allocate(34))
        assert (result.ok, result.reason) == (False, "corrupt")  # ...their bytes are not a record
        await engine.flush()
        assert engine.lookup(prompt + [1]) == 0  # dropped from the index, quarantined by the tier
        assert engine.statistics()["disk"]["corrupt"] >= 1
        engine.check()
    assert not sentinel.exists()

    # The file tier: a pickle where a record file should be.
    tier = await FileTier.open(tmp_path / "files")
    try:
        meta = ChunkMeta(b"m", 0, 0, "uint8", (64,))
        await tier.put_many([(stored[0], meta, memoryview(bytes(64)))])
        tier.path_for(stored[0]).write_bytes(payload)
        [got] = await tier.get_many_into([(stored[0], memoryview(bytearray(64)))])
        assert got is None and tier.statistics().as_dict()["corrupt"] == 1
    finally:
        await tier.close()
    assert not sentinel.exists()


@pytest.mark.asyncio
async def test_a_pickle_inside_a_valid_record_is_just_bytes(tmp_path: Path) -> None:
    # Someone who can write the cache directory forges a record (right key, meta and checksum)
    # whose payload is a pickle: it is restored as opaque bytes, never interpreted.
    cache, sentinel = tmp_path / "cache", tmp_path / "sentinel"
    device = make_cpu_device(LAYOUT)
    async with OffloadEngine(LAYOUT, device, config(cache), fingerprint=b"m") as engine:
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt)
        key = engine.request_keys(prompt).keys[0][0]
    with LmdbTier(cache, readonly=True) as tier:
        [info] = [i for i in tier.iter_records() if i.key == key]
    payload = pickle_payload(sentinel)
    raw = (payload * (info.header.raw_length // len(payload) + 1))[: info.header.raw_length]
    raw_put(cache, [(key, encode_record(key, info.header.meta, raw, CodecConfig(compress=False)))])
    async with OffloadEngine(LAYOUT, device, config(cache), fingerprint=b"m") as engine:
        scenario = OffloadScenario(engine)
        table = scenario.allocate(34)
        result = await engine.load(prompt + [1], 32, table)
        assert result.ok
        restored = b"".join(layer[table[0][0]].numpy().tobytes() for layer in device._groups[0].layers)
        assert restored == raw
    assert not sentinel.exists()


def test_no_deserializer_that_runs_code_is_reachable_from_kvtier() -> None:
    """No pickle/marshal/shelve/dill import, no torch.load, no eval/exec in the package code."""
    banned_modules = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
    found = []
    for folder in ("policy", "tiers", "engine", "tools"):
        for path in sorted((REPO / folder).glob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] in banned_modules]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in banned_modules:
                    found.append(f"{path.name}: from {node.module} import")
                elif isinstance(node, ast.Call):
                    f = node.func
                    if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
                        found.append(f"{path.name}:{node.lineno}: {f.id}()")
                    if isinstance(f, ast.Attribute) and f.attr == "load" and isinstance(f.value, ast.Name) and f.value.id == "torch":
                        found.append(f"{path.name}:{node.lineno}: torch.load()")
    assert found == []


# ------------------------------------------------------------------------------ lying headers

KEY = b"k" * 32
META = ChunkMeta(b"fp", 0, 0, "uint8", (4096,))
_PREFIX = struct.Struct("<4sHI")
_FIXED = struct.Struct("<BBBBIQQQ")


def forge(codec: int, raw_length: int, payload: bytes, planes: List[Tuple[int, int]], *, valid_checksum: bool,
          payload_length: int = -1, header_length: int = -1, key: bytes = KEY) -> bytes:
    """A record for ``key`` with the header fields given (see tiers.record_format's layout), checksummed
    (as only someone who can write the cache directory could) or not."""
    fp, dt = META.fingerprint, META.dtype.encode()
    body = (
        _FIXED.pack(codec, 1, 1, len(planes), 0, 0, raw_length, len(payload) if payload_length < 0 else payload_length)
        + struct.pack("<H", len(fp)) + fp + struct.pack("<B", len(dt)) + dt
        + struct.pack("<Q", 4096)
        + b"".join(struct.pack("<BQ", c, n) for c, n in planes)
    )
    hl = len(body) + 16 if header_length < 0 else header_length
    prefix = _PREFIX.pack(b"KVTR", 1, hl)
    checksum = _checksum(key, prefix, body, payload) if valid_checksum else b"\0" * 16
    return prefix + body + checksum + payload


def _zstd_frame(content: int) -> bytes:
    """A 16-byte zstd frame whose header declares ``content`` bytes: magic, a single-segment
    descriptor with an 8-byte content size, then one empty last raw block."""
    return struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", content) + b"\x01\x00\x00"


HOSTILE = {
    "header length 4 GiB": lambda: _PREFIX.pack(b"KVTR", 1, 0xFFFFFFFF) + b"\0" * 64,
    "raw payload claims 1 TiB": lambda: forge(0, 1 << 40, b"x" * 16, [], valid_checksum=False, payload_length=1 << 40),
    "zstd planes claim 1 TiB, checksum ok": lambda: forge(1, 1 << 40, _zstd_frame(1 << 40), [(1, 16)], valid_checksum=True),
    "zstd planes claim 1 GiB, bad checksum": lambda: forge(1, 1 << 30, _zstd_frame(1 << 30), [(1, 16)], valid_checksum=False),
    "plane table does not add up": lambda: forge(1, 1 << 30, b"z" * 16, [(1, 1 << 20)], valid_checksum=True),
    "raw plane larger than the record": lambda: forge(1, 1 << 30, b"z" * 16, [(0, 1 << 30)], valid_checksum=True),
    "zstd frame declares more than its plane": lambda: forge(1, 4096, _zstd_frame(1 << 30), [(1, 16)], valid_checksum=True),
}


def peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_lying_headers_are_rejected_before_allocation(name: str) -> None:
    record = HOSTILE[name]()

    def decode() -> None:
        with pytest.raises(CorruptRecordError):
            # No output buffer: decode_record would allocate the claimed raw length if it got that
            # far. Default cap (2 GiB): a forged valid checksum only gets that far below it.
            decode_record(KEY, record)

    assert peak_bytes(decode) < 1 << 20, name


@pytest.mark.asyncio
async def test_lying_headers_in_the_tiers_cost_no_allocation(tmp_path: Path) -> None:
    # One forged record with a valid checksum claiming more than the tier's cap, one corrupt record
    # claiming 1 GiB: verify() used to size its scratch buffer from the header before checking.
    cap = 64 << 20
    a, b = b"a" * 32, b"b" * 32
    forged = {
        a: forge(1, 1 << 32, _zstd_frame(1 << 32), [(1, 16)], valid_checksum=True, key=a),  # over the cap
        b: forge(1, 48 << 20, _zstd_frame(48 << 20), [(1, 16)], valid_checksum=False, key=b),  # under it
    }
    assert validate_record(a, forged[a], max_raw_bytes=1 << 40).raw_length == 1 << 32
    cache = tmp_path / "cache"
    with LmdbTier(cache):
        pass
    raw_put(cache, list(forged.items()))
    async with await LmdbTier.open(cache, max_raw_bytes=cap) as tier:
        report_box = []
        assert peak_bytes(lambda: report_box.append(tier.verify(quarantine=False))) < 4 << 20
        assert sorted(k for k, _ in report_box[0].corrupt) == sorted(forged)

        async def read() -> None:
            metas = await tier.get_many_into([(k, memoryview(bytearray(4096))) for k in forged])
            assert metas == [None, None]

        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            await read()
            assert tracemalloc.get_traced_memory()[1] < 4 << 20
        finally:
            tracemalloc.stop()

    # The file tier reads at most the buffer's size plus a header's worth of a grown file.
    files = await FileTier.open(tmp_path / "files")
    try:
        key = b"c" * 32
        await files.put_many([(key, META, memoryview(bytes(4096)))])
        with open(files.path_for(key), "r+b") as f:
            f.seek(64 << 20)
            f.write(b"!")  # 64 MiB now
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            [meta] = await files.get_many_into([(key, memoryview(bytearray(4096)))])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert meta is None and peak < 4 << 20
    finally:
        await files.close()


# --------------------------------------------------------------------------- salts, fingerprints


@pytest.mark.asyncio
async def test_keys_of_other_tenants_and_other_models_never_meet(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"model-a") as engine:
        scenario = OffloadScenario(engine)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt, salt=b"tenant-a")
        assert engine.lookup(prompt + [1], salt=b"tenant-a") == 32
        assert engine.lookup(prompt + [1], salt=b"tenant-b") == 0
        assert engine.lookup(prompt + [1]) == 0  # unsalted is its own tenant
        a_keys = {k for g in engine.request_keys(prompt, salt=b"tenant-a").keys for k in g}
        for salt in (b"tenant-b", None, "tenant-a ", b""):
            other = {k for g in engine.request_keys(prompt, salt=salt).keys for k in g}
            assert not a_keys & other, salt
        stored = engine.take_events()
        a_order = [e.key for e in stored if e.kind == "stored" and e.tier == "disk"]
        a_position = {k: (g, c) for g, group in enumerate(engine.request_keys(prompt, salt=b"tenant-a").keys)
                      for c, k in enumerate(group)}

    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"model-b") as engine:
        scenario = OffloadScenario(engine)
        for salt in (b"tenant-a", None):
            assert engine.lookup(prompt + [1], salt=salt) == 0
            assert not a_keys & {k for g in engine.request_keys(prompt, salt=salt).keys for k in g}
        b_keys = engine.request_keys(prompt, salt=b"tenant-a").keys
        b_order = [b_keys[g][c] for g, c in (a_position[k] for k in a_order)]

    # Copy model A's records under model B's keys: the checksum binds the key, so B gets misses,
    # never A's bytes.
    raw_put(cache, [(bk, raw_get(cache, ak)) for ak, bk in zip(a_order, b_order)])
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"model-b") as engine:
        scenario = OffloadScenario(engine)
        keys = engine.request_keys(prompt + [1], salt=b"tenant-a")
        assert engine.lookup(keys) == 32  # the keys exist now...
        result = await engine.load(keys, 32, scenario.allocate(34))
        assert (result.ok, result.reason) == (False, "corrupt")  # ...but no record verifies under them
        await engine.flush()
        assert engine.lookup(keys) == 0
        engine.check()
