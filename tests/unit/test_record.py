"""The chunk record codec: golden bytes, bitwise round trips, codec choice, and a parser that only
ever raises CorruptRecordError (before allocating anything of the claimed size)."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import CorruptRecordError, KvtierError
from kvtier.tiers import record_layout
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.record_format import (
    CODEC_RAW,
    CODEC_ZSTD_PLANES,
    MAX_HEADER_BYTES,
    CodecConfig,
    RecordChecksumError,
    RecordFormatError,
    RecordMetaMismatchError,
    RecordSizeMismatchError,
    decode_record,
    element_size,
    encode_record,
    read_header,
)

KEY = bytes(range(32))

# ----------------------------------------------------------------------------------- golden bytes

GOLDEN_META = ChunkMeta(b"fp-golden", 1, 7, "float16", (2, 3))
GOLDEN_RAW = bytes.fromhex("0000003c00c00038ff7b0080")  # float16 [0, 1, -2, 0.5, 65504, -0]
GOLDEN_RECORD = bytes.fromhex(
    "4b565452"  # magic KVTR
    "0100"  # version 1
    "53000000"  # header length 83
    "00" "02" "02" "00"  # codec raw, element size 2, ndim 2, 0 planes
    "01000000"  # group 1
    "0700000000000000"  # chunk 7
    "0c00000000000000"  # raw length 12
    "0c00000000000000"  # payload length 12
    "0900" "66702d676f6c64656e"  # fingerprint
    "07" "666c6f61743136"  # dtype "float16"
    "0200000000000000" "0300000000000000"  # shape (2, 3)
    "6d9f22696e88d463325ab5b39a2100ce"  # xxh3-128 checksum
    "0000003c00c00038ff7b0080"  # payload
)

# zstd output may change across zstd versions, so this pins the decoder, not the encoder.
GOLDEN_ZSTD_META = ChunkMeta(b"fp-golden", 0, 2, "bfloat16", (64,))
GOLDEN_ZSTD_RECORD = bytes.fromhex(
    "4b56545201005e0000000102010200000000020000000000000080000000000000002200000000000000090066702d"
    "676f6c64656e0862666c6f617431364000000000000000011100000000000000011100000000000000f9c9c4a9b3a3"
    "8d335e7855b37f7fd82728b52ffd2040450000108080010093001628b52ffd2040450000103f3f0100930016"
)


def test_golden_raw_record_bytes_are_pinned() -> None:
    record = encode_record(KEY, GOLDEN_META, GOLDEN_RAW, CodecConfig(compress=False))
    assert record == GOLDEN_RECORD
    meta, view = decode_record(KEY, GOLDEN_RECORD, expected=GOLDEN_META)
    assert meta == GOLDEN_META and bytes(view) == GOLDEN_RAW


def test_golden_zstd_planes_record_decodes() -> None:
    header = read_header(GOLDEN_ZSTD_RECORD)
    assert header.codec == CODEC_ZSTD_PLANES
    assert header.planes == (("zstd", 17), ("zstd", 17))
    meta, view = decode_record(KEY, GOLDEN_ZSTD_RECORD)
    assert meta == GOLDEN_ZSTD_META
    assert bytes(view) == torch.full((64,), 1.0, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_read_header_fields() -> None:
    h = read_header(GOLDEN_RECORD)
    assert (h.codec, h.element_size, h.raw_length, h.payload_length) == (CODEC_RAW, 2, 12, 12)
    assert h.meta == GOLDEN_META and h.version == 1 and h.record_length == len(GOLDEN_RECORD)


# ------------------------------------------------------------------------------------ round trips

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
SHAPES = [(1,), (3, 5, 7), (13, 17), (2, 1, 9, 3)]


def _tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    flat = t.reshape(-1)
    if dtype != torch.float8_e4m3fn and flat.numel() >= 3:
        flat[0], flat[1], flat[2] = float("nan"), float("inf"), -0.0
    return t


def _meta(t: torch.Tensor, chunk: int = 0) -> ChunkMeta:
    return ChunkMeta(b"fp", 0, chunk, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("compress", [True, False])
def test_round_trip_bitwise_into_host_slot(dtype: torch.dtype, shape: tuple, compress: bool) -> None:
    t = _tensor(dtype, shape, seed=zlib.crc32(repr((dtype, shape)).encode()))
    raw = _raw(t)
    record = encode_record(KEY, _meta(t), raw, CodecConfig(compress=compress))
    slot = torch.zeros(raw.nbytes, dtype=torch.uint8)  # a host slot
    meta, view = decode_record(KEY, record, memoryview(slot.numpy()), expected=_meta(t))
    assert meta == _meta(t)
    back = slot.view(dtype).reshape(shape)
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    assert bytes(view) == raw.tobytes()


def test_compressible_bf16_picks_planes_random_picks_raw() -> None:
    t = (torch.randn(64 * 1024) * 0.02).to(torch.bfloat16)
    rec = encode_record(KEY, _meta(t), _raw(t))
    h = read_header(rec)
    assert h.codec == CODEC_ZSTD_PLANES
    assert len(rec) < 0.9 * _raw(t).nbytes
    assert [name for name, _ in h.planes] == ["raw", "zstd"]  # low byte barely compresses, high byte does

    noise = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8).view(torch.bfloat16)
    rec = encode_record(KEY, _meta(noise), _raw(noise))
    assert read_header(rec).codec == CODEC_RAW

    strict = CodecConfig(min_savings_fraction=0.9)
    assert read_header(encode_record(KEY, _meta(t), _raw(t), strict)).codec == CODEC_RAW
    assert read_header(encode_record(KEY, _meta(t), _raw(t), CodecConfig(level=5))).codec == CODEC_ZSTD_PLANES


def test_one_byte_dtype_compresses_as_one_plane() -> None:
    t = torch.zeros(4096, dtype=torch.float8_e4m3fn)
    rec = encode_record(KEY, _meta(t), _raw(t))
    h = read_header(rec)
    assert h.codec == CODEC_ZSTD_PLANES and len(h.planes) == 1
    assert bytes(decode_record(KEY, rec)[1]) == _raw(t).tobytes()


def test_empty_chunk_round_trips() -> None:
    meta = ChunkMeta(b"fp", 0, 0, "bfloat16", (0,))
    rec = encode_record(KEY, meta, b"")
    assert decode_record(KEY, rec, bytearray(0))[0] == meta


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"level": 0}, "level"),
        ({"level": 23}, "level"),
        ({"level": 1.5}, "level"),
        ({"min_savings_fraction": 1.0}, "min_savings_fraction"),
        ({"min_savings_fraction": -0.1}, "min_savings_fraction"),
        ({"min_savings_fraction": float("nan")}, "min_savings_fraction"),
        ({"compress": 1}, "compress"),
    ],
)
def test_codec_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CodecConfig(**kwargs)


def test_encode_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_record(KEY, ChunkMeta(b"fp", 0, 0, "complex32", (1,)), b"ab")
    with pytest.raises(ValueError, match="group_index"):
        encode_record(KEY, ChunkMeta(b"fp", -1, 0, "uint8", (1,)), b"a")
    with pytest.raises(TypeError):
        encode_record(KEY, ChunkMeta(b"fp", 0, 0, "uint8", (1,)), "text")  # type: ignore[arg-type]
    assert element_size("bfloat16") == 2 and element_size("float8_e4m3fn") == 1


# --------------------------------------------------------------------------------- malformed input

_BF16 = (torch.randn(4096) * 0.02).to(torch.bfloat16)
VALID_ZSTD = encode_record(KEY, _meta(_BF16), _raw(_BF16))
VALID_RAW = encode_record(KEY, _meta(_BF16), _raw(_BF16), CodecConfig(compress=False))
assert read_header(VALID_ZSTD).codec == CODEC_ZSTD_PLANES


def _forge(
    *,
    magic: bytes = b"KVTR",
    version: int = 1,
    codec: int = 0,
    esize: int = 1,
    group: int = 0,
    chunk: int = 0,
    raw_length: int = 4,
    payload_length: int | None = None,
    fingerprint: bytes = b"fp",
    dtype: bytes = b"uint8",
    shape: tuple = (4,),
    planes: tuple = (),
    payload: bytes = b"abcd",
    header_length: int | None = None,
    key: bytes = KEY,
    bad_checksum: bool = False,
    ndim: int | None = None,
    header_extra: bytes = b"",
) -> bytes:
    """A record with arbitrary field values and (unless told otherwise) a correct checksum."""
    if payload_length is None:
        payload_length = len(payload)
    body = struct.pack(
        "<BBBBIQQQ",
        codec,
        esize,
        len(shape) if ndim is None else ndim,
        len(planes),
        group,
        chunk,
        raw_length,
        payload_length,
    )
    body += struct.pack("<H", len(fingerprint)) + fingerprint + struct.pack("<B", len(dtype)) + dtype
    body += b"".join(struct.pack("<Q", d) for d in shape)
    body += b"".join(struct.pack("<BQ", c, n) for c, n in planes) + header_extra
    hl = len(body) + 16 if header_length is None else header_length
    prefix = struct.pack("<4sHI", magic, version, hl)
    h = xxhash.xxh3_128()
    for part in (struct.pack("<I", len(key)), key, prefix, body, payload):
        h.update(part)
    digest = h.digest()
    if bad_checksum:
        digest = bytes([digest[0] ^ 1]) + digest[1:]
    return prefix + body + digest + payload


def test_forge_matches_the_encoder() -> None:
    assert _forge() == encode_record(KEY, ChunkMeta(b"fp", 0, 0, "uint8", (4,)), b"abcd", CodecConfig(compress=False))


def _flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1 :]


_HUGE = 1 << 40
MALFORMED = {
    "empty": b"",
    "short prefix": b"KVTR\x01",
    "bad magic": b"XXXX" + VALID_RAW[4:],
    "unknown version": _forge(version=2),
    "header too long": _forge(header_length=MAX_HEADER_BYTES + 1),
    "header too short": _forge(header_length=8),
    "header truncated": _forge()[:40],
    "unknown codec": _forge(codec=9),
    "unknown dtype": _forge(dtype=b"float128"),
    "non-ascii dtype": _forge(dtype=b"\xff\xfe"),
    "element size mismatch": _forge(esize=2),
    "ndim too large": _forge(ndim=200, shape=()),
    "raw codec length mismatch": _forge(raw_length=5),
    "payload truncated": _forge()[:-1],
    "extra bytes": _forge() + b"!",
    "checksum mismatch": _forge(bad_checksum=True),
    "flipped payload byte": _flip(VALID_ZSTD, len(VALID_ZSTD) - 10),
    "flipped header byte": _flip(VALID_ZSTD, 20),
    "flipped checksum byte": _flip(VALID_RAW, read_header(VALID_RAW).header_length + 10 - 3),
    "raw length 2**40 (raw codec)": _forge(raw_length=_HUGE, payload_length=_HUGE),
    "raw length 2**40 (planes)": _forge(codec=1, raw_length=_HUGE, planes=((1, 4),)),
    "planes != element size": _forge(codec=1, esize=1, planes=((1, 2), (1, 2))),
    "unknown plane codec": _forge(codec=1, planes=((7, 4),)),
    "plane lengths do not add up": _forge(codec=1, planes=((1, 3),)),
    "raw plane of wrong size": _forge(codec=1, raw_length=8, planes=((0, 4),)),
    "zstd frame garbage": _forge(codec=1, planes=((1, 4),)),
    "zstd frame of wrong size": _forge(
        codec=1, raw_length=8, planes=((1, len(zstandard.compress(b"abcd"))),), payload=zstandard.compress(b"abcd")
    ),
    "zstd frame without content size": _forge(
        codec=1,
        raw_length=4,
        planes=((1, len(zstandard.ZstdCompressor(write_content_size=False).compress(b"abcd"))),),
        payload=zstandard.ZstdCompressor(write_content_size=False).compress(b"abcd"),
    ),
    "trailing header bytes": _forge(header_extra=b"\x00\x00\x00"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_record_raises_corrupt_record_error(name: str) -> None:
    record = MALFORMED[name]
    with pytest.raises(CorruptRecordError):
        decode_record(KEY, record)
    with pytest.raises(CorruptRecordError):
        decode_record(KEY, record, bytearray(4))


@pytest.mark.parametrize(
    "record",
    [
        _forge(raw_length=_HUGE, payload_length=_HUGE),
        _forge(codec=1, raw_length=_HUGE, planes=((1, 4),)),
        _forge(raw_length=1 << 30, payload_length=1 << 30),  # under the limit but truncated
        _forge(codec=1, raw_length=1 << 30, planes=((1, 4),), bad_checksum=True),
    ],
)
def test_hostile_lengths_fail_before_any_allocation(record: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecordError):
            decode_record(KEY, record)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_wrong_key_expected_meta_and_buffer_size() -> None:
    with pytest.raises(RecordChecksumError):
        decode_record(b"another key", VALID_RAW)
    other = ChunkMeta(b"fp", 0, 1, "bfloat16", tuple(_BF16.shape))
    with pytest.raises(RecordMetaMismatchError):
        decode_record(KEY, VALID_ZSTD, expected=other)
    with pytest.raises(RecordSizeMismatchError):
        decode_record(KEY, VALID_ZSTD, bytearray(10))
    assert read_header(VALID_ZSTD).raw_length == 8192
    with pytest.raises(RecordFormatError):
        decode_record(KEY, VALID_ZSTD, max_raw_bytes=8191)


def test_checksum_failure_leaves_the_output_untouched() -> None:
    out = bytearray(b"\x55" * 8192)
    with pytest.raises(RecordChecksumError):
        decode_record(KEY, _flip(VALID_RAW, len(VALID_RAW) - 1), out)
    assert out == bytearray(b"\x55" * 8192)


def test_readonly_output_is_a_usage_error() -> None:
    with pytest.raises(ValueError, match="writable"):
        decode_record(KEY, VALID_RAW, bytes(8192))


def test_decode_from_memoryview_slices() -> None:
    padded = b"??" + VALID_ZSTD + b"??"
    view = memoryview(padded)[2:-2]
    meta, out = decode_record(KEY, view)
    assert bytes(out) == _raw(_BF16).tobytes()


# ------------------------------------------------------------------------------------------ fuzz

_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_only_kvtier_errors(record: bytes, out_size: int | None = None) -> None:
    try:
        decode_record(KEY, record, None if out_size is None else bytearray(out_size), max_raw_bytes=1 << 20)
    except CorruptRecordError:
        pass
    try:
        read_header(record)
    except CorruptRecordError:
        pass


@_FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_only_kvtier_errors(data)
    _decode_only_kvtier_errors(b"KVTR\x01\x00" + data)


_BASES = [VALID_RAW, VALID_ZSTD, GOLDEN_RECORD, GOLDEN_ZSTD_RECORD]


@_FUZZ
@given(
    st.integers(0, len(_BASES) - 1),
    st.dictionaries(st.integers(0, 1 << 20), st.integers(1, 255), min_size=1, max_size=8),
    st.integers(0, 3),
    st.binary(max_size=16),
)
def test_fuzz_mutated_records(base_index: int, flips: dict, cut: int, tail: bytes) -> None:
    base = _BASES[base_index]
    data = bytearray(base)
    for pos, xor in {p % len(base): x for p, x in flips.items()}.items():
        data[pos] ^= xor
    mutated = bytes(data)
    assert mutated != base
    with pytest.raises(CorruptRecordError):
        decode_record(KEY, mutated)
    _decode_only_kvtier_errors(mutated[: len(mutated) - cut] + tail)


@_FUZZ
@given(
    codec=st.integers(0, 2),
    esize=st.sampled_from([1, 2, 4, 8, 0, 255]),
    dtype=st.sampled_from([b"uint8", b"bfloat16", b"float32", b"float64", b"nope"]),
    raw_length=st.one_of(st.integers(0, 64), st.sampled_from([1 << 20, (1 << 20) + 1, 1 << 40, (1 << 64) - 1])),
    planes=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 64)), max_size=9),
    payload=st.one_of(
        st.binary(max_size=96),
        st.binary(max_size=32).map(zstandard.compress),
        st.binary(max_size=32).map(lambda b: zstandard.compress(b) + zstandard.compress(b)),
    ),
    shape=st.lists(st.integers(0, (1 << 64) - 1), max_size=4).map(tuple),
)
def test_fuzz_forged_records_with_valid_checksums(
    codec: int, esize: int, dtype: bytes, raw_length: int, planes: list, payload: bytes, shape: tuple
) -> None:
    # Valid checksums carry the fuzz past the integrity check into the codec paths.
    if planes and codec == 1:
        lengths = [n for _, n in planes]
        lengths[-1] = max(0, len(payload) - sum(lengths[:-1]))
        planes = [(c, n) for (c, _), n in zip(planes, lengths)]
    record = _forge(
        codec=codec, esize=esize, dtype=dtype, raw_length=raw_length, planes=tuple(planes), payload=payload, shape=shape
    )
    try:
        meta, view = decode_record(KEY, record, max_raw_bytes=1 << 20)
    except CorruptRecordError:
        return
    assert view.nbytes == raw_length <= 1 << 20
    out = bytearray(raw_length)
    assert decode_record(KEY, record, out)[0] == meta and bytes(out) == bytes(view)


def test_error_family() -> None:
    for cls in (RecordFormatError, RecordChecksumError, RecordMetaMismatchError, RecordSizeMismatchError):
        assert issubclass(cls, CorruptRecordError) and issubclass(cls, KvtierError)


def test_plane_split_matches_numpy_reference() -> None:
    raw = np.arange(4 * 1000, dtype=np.uint32).view(np.uint8)
    meta = ChunkMeta(b"fp", 0, 0, "float32", (1000,))
    rec = encode_record(KEY, meta, raw)
    h = read_header(rec)
    assert h.codec == CODEC_ZSTD_PLANES and len(h.planes) == 4
    assert bytes(decode_record(KEY, rec)[1]) == raw.tobytes()


class _RecordingXxh3:
    """xxhash.xxh3_128 that remembers the size of every update (python-xxhash releases the GIL
    for an update above 64 KiB, which beside busy threads costs milliseconds a return)."""

    def __init__(self, sizes: list) -> None:
        self._hasher = xxhash.xxh3_128()
        self._sizes = sizes

    def update(self, data) -> None:
        self._sizes.append(memoryview(data).nbytes)
        self._hasher.update(data)

    def digest(self) -> bytes:
        return self._hasher.digest()


@pytest.mark.parametrize("part_sizes", [(), (0,), (1,), (65535, 65536, 65537), (1 << 20, 3, (4 << 20) + 7)])
def test_checksum_in_slices_equals_one_pass_and_no_update_releases_the_gil(part_sizes: tuple, monkeypatch) -> None:
    rng = np.random.default_rng(len(part_sizes))
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in part_sizes]
    # The same bytes as other buffer shapes: a 2-D float16 tensor view and a bytearray.
    shaped = [memoryview(torch.from_numpy(p[: p.size // 4 * 4].copy()).view(torch.float16).view(-1, 2).numpy())
              if p.size >= 8 else bytearray(p.tobytes()) for p in parts]
    whole = b"".join(bytes(memoryview(s).cast("B")) for s in shaped)
    expected = xxhash.xxh3_128(struct.pack("<I", len(KEY)) + KEY + b"prefix" + b"body" + whole).digest()
    sizes: list = []
    monkeypatch.setattr(record_layout, "xxhash", type("xxhash", (), {"xxh3_128": lambda: _RecordingXxh3(sizes)}))
    assert record_layout.checksum(KEY, b"prefix", b"body", *shaped) == expected
    assert max(sizes) <= record_layout.HASH_SLICE_BYTES == 64 << 10
    assert sum(sizes) == 4 + len(KEY) + len(b"prefixbody") + len(whole)
