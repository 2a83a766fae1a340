"""The chunk record: the self-describing, checksummed byte string every tier below the host pool stores.

Primitives: ``CodecConfig`` (how to encode), ``encode_record`` (chunk bytes -> record),
``decode_record`` (record -> chunk bytes, straight into a caller's buffer), ``read_header`` (structure
and meta without touching the payload), ``validate_record`` (structure, size cap and checksum, without
decoding or allocating), ``RecordHeader``, and the ``CorruptRecordError`` subclasses
``RecordFormatError``, ``RecordChecksumError``, ``RecordMetaMismatchError``, ``RecordSizeMismatchError``.
All are plain synchronous functions, safe on any thread (zstd contexts and scratch buffers are kept
per thread); tiers call them on their worker threads, never on the event loop.

Layout (all integers little-endian)::

    prefix   magic b"KVTR" | format version u16 (= 1) | header length u32        (10 bytes)
    header   codec u8 | element size u8 | ndim u8 | plane count u8 | group index u32
             | chunk index u64 | raw length u64 | payload length u64                 (32 bytes)
             | fingerprint length u16 | fingerprint
             | dtype name length u8 | dtype name (ASCII, torch name without "torch.")
             | ndim x dim u64
             | plane count x (plane codec u8 | stored length u64)
             | checksum (16 bytes, XXH3-128)
    payload  codec 0 "raw": the chunk bytes
             codec 1 "zstd-planes": the planes one after another; plane i holds byte i of every
             element, stored raw (plane codec 0) or as one zstd frame with its content size (1)

The checksum is XXH3-128 over ``len(key) u32 | key | prefix | header without its checksum | payload``:
a record copied under another key, or with any byte changed, fails it. It guards against corruption,
not against an attacker who can write the cache directory (that is what the 0700 directory is for).

Decoding checks, in this order and before any allocation of the chunk's size: magic, version,
header length (capped at 64 KiB), every header field, the plane table against the payload length,
the record length, ``raw_length <= max_raw_bytes``, the checksum, the expected meta, the caller's
buffer size. Only then is the payload copied or decompressed, and a zstd frame may never produce
more or fewer bytes than its plane holds. No pickle, no ``torch.load``, no ``eval``.

``ChunkMeta.shape`` is carried as metadata; its product is not required to match the raw length
(the device view decides what a chunk's shape means).
"""

from __future__ import annotations

import math
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import xxhash
import zstandard

from kvtier.errors import (  # the Record* classes are re-exported from here for one release
    RecordChecksumError,
    RecordFormatError,
    RecordMetaMismatchError,
    RecordSizeMismatchError,
)

from .base import ChunkMeta

__all__ = [
    "CodecConfig",
    "RecordHeader",
    "encode_record",
    "encode_record_parts",
    "decode_record",
    "read_header",
    "validate_record",
    "header_end_of",
    "read_head",
    "check_payload_in_place",
    "decode_split",
    "element_size",
    "RecordFormatError",
    "RecordChecksumError",
    "RecordMetaMismatchError",
    "RecordSizeMismatchError",
    "MAGIC",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "CODEC_RAW",
    "CODEC_ZSTD_PLANES",
]

BytesLike = Union[bytes, bytearray, memoryview]

MAGIC = b"KVTR"
FORMAT_VERSION = 1
# A header is a few hundred bytes; the cap keeps a hostile length field from costing anything.
MAX_HEADER_BYTES = 64 * 1024
MAX_NDIM = 16
MAX_FINGERPRINT_BYTES = 4096

CODEC_RAW = "raw"
CODEC_ZSTD_PLANES = "zstd-planes"
_CODEC_IDS = {CODEC_RAW: 0, CODEC_ZSTD_PLANES: 1}
_CODEC_NAMES = {v: k for k, v in _CODEC_IDS.items()}
_PLANE_RAW = 0
_PLANE_ZSTD = 1

_PREFIX = struct.Struct("<4sHI")
_FIXED = struct.Struct("<BBBBIQQQ")
_U16 = struct.Struct("<H")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PLANE = struct.Struct("<BQ")
_CHECKSUM_BYTES = 16
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
_LITTLE_ENDIAN = sys.byteorder == "little"

# Bytes per element of the dtypes a KV cache uses (torch names without "torch.").
_ELEMENT_SIZES: Dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
}




def element_size(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``"bfloat16"`` -> 2); ``ValueError`` if unknown."""
    try:
        return _ELEMENT_SIZES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; known: {', '.join(sorted(_ELEMENT_SIZES))}"
        ) from None


@dataclass(frozen=True)
class CodecConfig:
    """How records are encoded.

    ``level``: zstd level 1..22 (level 1 uses the fast match-finder parameters measured in DESIGN.md:
    min_match 7, search_log 1, hash_log 6). ``min_savings_fraction``: keep the compressed form only
    if it is at least this fraction smaller than raw (0 <= f < 1). ``compress``: False stores raw.
    """

    level: int = 1
    min_savings_fraction: float = 0.10
    compress: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.level, int) or isinstance(self.level, bool):
            raise ValueError(f"level must be an int, got {self.level!r}")
        if not 1 <= self.level <= 22:
            raise ValueError(f"level must be in 1..22, got {self.level}")
        if isinstance(self.min_savings_fraction, bool) or not isinstance(
            self.min_savings_fraction, (int, float)
        ):
            raise ValueError(f"min_savings_fraction must be a number, got {self.min_savings_fraction!r}")
        if not (0.0 <= float(self.min_savings_fraction) < 1.0) or math.isnan(self.min_savings_fraction):
            raise ValueError(f"min_savings_fraction must be in [0, 1), got {self.min_savings_fraction}")
        if not isinstance(self.compress, bool):
            raise ValueError(f"compress must be a bool, got {self.compress!r}")


@dataclass(frozen=True)
class RecordHeader:
    """What ``read_header`` finds in a record (the payload is not decoded, the checksum not checked)."""

    meta: ChunkMeta
    codec: str
    element_size: int
    raw_length: int
    payload_length: int
    header_length: int
    version: int
    # Per plane (codec name, stored bytes); empty for the raw codec.
    planes: Tuple[Tuple[str, int], ...]
    checksum: bytes

    @property
    def record_length(self) -> int:
        return _PREFIX.size + self.header_length + self.payload_length


# --------------------------------------------------------------------------------------- thread state

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        if level == 1:
            params = zstandard.ZstdCompressionParameters.from_level(
                1, min_match=7, search_log=1, hash_log=6, write_content_size=True
            )
        else:
            params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True)
        cctx = cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _scratch(nbytes: int) -> memoryview:
    """A per-thread buffer reused across decodes (a plane at a time), so decoding allocates nothing."""
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.scratch = bytearray(max(nbytes, 1 << 16))
    return memoryview(buf)[:nbytes]


def _plane_scratch(nbytes: int) -> np.ndarray:
    """A per-thread buffer for the planes of one encode (separate from the decode scratch). Reused,
    because a fresh multi-MiB allocation costs a page fault per 4 KiB (on these VMs ~1 GB/s), more
    than the split itself."""
    buf = getattr(_local, "plane_scratch", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.plane_scratch = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
    return buf[:nbytes]


def _split_planes(view: memoryview, esize: int) -> List[memoryview]:
    """Byte ``i`` of every element into plane ``i`` (in memory order), in this thread's scratch: valid
    until the thread's next encode. For 2-byte elements on a little-endian host two vectorised
    integer ops (low byte, high byte) run ~5x faster than the general transposing copy."""
    n = view.nbytes // esize
    out = _plane_scratch(view.nbytes).reshape(esize, n)
    src = np.frombuffer(view, dtype=np.uint8)
    if esize == 2 and _LITTLE_ENDIAN:
        words = src.view(np.uint16)
        np.copyto(out[0], words, casting="unsafe")  # keeps the low byte: byte 0 in memory
        np.right_shift(words, 8, out=out[1], casting="unsafe")
    else:
        np.copyto(out, src.reshape(n, esize).T)
    return [memoryview(out[i]) for i in range(esize)]


# ------------------------------------------------------------------------------------------- encode


def _as_byte_view(data: object, name: str) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be a bytes-like object, got {type(data).__name__}") from None
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        view = view.cast("B")
    return view


def _encode_header(
    key: bytes,
    meta: ChunkMeta,
    codec_id: int,
    esize: int,
    raw_length: int,
    planes: List[Tuple[int, int]],
    payload_length: int,
) -> bytes:
    fp = bytes(meta.fingerprint)
    dt = meta.dtype.encode("ascii")
    parts = [
        _FIXED.pack(
            codec_id,
            esize,
            len(meta.shape),
            len(planes),
            meta.group_index,
            meta.chunk_index,
            raw_length,
            payload_length,
        ),
        _U16.pack(len(fp)),
        fp,
        _U8.pack(len(dt)),
        dt,
    ]
    parts.extend(_U64.pack(d) for d in meta.shape)
    parts.extend(_PLANE.pack(c, n) for c, n in planes)
    return b"".join(parts)


def _checksum(key: BytesLike, prefix: BytesLike, header_body: BytesLike, payload: BytesLike) -> bytes:
    h = xxhash.xxh3_128()
    h.update(_U32.pack(len(key)))
    h.update(key)
    h.update(prefix)
    h.update(header_body)
    h.update(payload)
    return h.digest()


def _check_meta_for_encode(meta: ChunkMeta) -> int:
    if not isinstance(meta, ChunkMeta):
        raise TypeError(f"meta must be a ChunkMeta, got {type(meta).__name__}")
    if not isinstance(meta.fingerprint, (bytes, bytearray)) or len(meta.fingerprint) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"meta.fingerprint must be bytes of at most {MAX_FINGERPRINT_BYTES} bytes")
    if not 0 <= meta.group_index <= _U32_MAX:
        raise ValueError(f"meta.group_index out of range: {meta.group_index}")
    if not 0 <= meta.chunk_index <= _U64_MAX:
        raise ValueError(f"meta.chunk_index out of range: {meta.chunk_index}")
    if len(meta.shape) > MAX_NDIM or any(not 0 <= int(d) <= _U64_MAX for d in meta.shape):
        raise ValueError(f"meta.shape must have at most {MAX_NDIM} non-negative dims, got {meta.shape}")
    try:
        meta.dtype.encode("ascii")
    except (UnicodeEncodeError, AttributeError):
        raise ValueError(f"meta.dtype must be an ASCII dtype name, got {meta.dtype!r}") from None
    return element_size(meta.dtype)


def encode_record(key: bytes, meta: ChunkMeta, raw: BytesLike, config: CodecConfig = CodecConfig()) -> bytes:
    """Encode one chunk's bytes as a record (see the module docstring for the layout); the
    record is ``encode_record_parts`` joined."""
    return b"".join(encode_record_parts(key, meta, raw, config))


def encode_record_parts(key: bytes, meta: ChunkMeta, raw: BytesLike, config: CodecConfig = CodecConfig()) -> List[BytesLike]:
    """The record of ``encode_record`` as the parts that make it up, in order (the raw payload
    part is a view of ``raw``: copy the parts before ``raw`` changes). For a caller that places the
    record in a buffer of its own (LMDB's segment writer) instead of a fresh ``bytes``.

    ``raw`` is any C-contiguous bytes-like object (a memoryview of a host slot); it is only read.
    With ``config.compress`` the elements are split into byte planes and each plane is zstd
    compressed where that helps; the result is kept only if it saves ``min_savings_fraction``.
    Raises ``ValueError``/``TypeError`` for bad arguments (unknown dtype, out-of-range meta).
    """
    key = bytes(key)
    esize = _check_meta_for_encode(meta)
    view = _as_byte_view(raw, "raw")
    raw_length = view.nbytes

    codec_id = _CODEC_IDS[CODEC_RAW]
    plane_table: List[Tuple[int, int]] = []
    payload_parts: List[BytesLike] = [view]
    if config.compress and raw_length > 0 and raw_length % esize == 0:
        cctx = _compressor(config.level)
        if esize == 1:
            plane_views: List[BytesLike] = [view]
        else:
            plane_views = _split_planes(view, esize)
        stored: List[BytesLike] = []
        table: List[Tuple[int, int]] = []
        for pv in plane_views:
            packed = cctx.compress(pv)
            if len(packed) < memoryview(pv).nbytes:
                stored.append(packed)
                table.append((_PLANE_ZSTD, len(packed)))
            else:
                stored.append(pv)
                table.append((_PLANE_RAW, memoryview(pv).nbytes))
        total = sum(n for _, n in table)
        if total <= raw_length * (1.0 - float(config.min_savings_fraction)) and total < raw_length:
            codec_id = _CODEC_IDS[CODEC_ZSTD_PLANES]
            plane_table = table
            payload_parts = stored

    payload_length = sum(memoryview(p).nbytes for p in payload_parts)
    body = _encode_header(key, meta, codec_id, esize, raw_length, plane_table, payload_length)
    header_length = len(body) + _CHECKSUM_BYTES
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, header_length)
    h = xxhash.xxh3_128()
    h.update(_U32.pack(len(key)))
    h.update(key)
    h.update(prefix)
    h.update(body)
    for p in payload_parts:
        h.update(p)
    return [prefix, body, h.digest(), *payload_parts]


# ------------------------------------------------------------------------------------------- decode


class _Cursor:
    """Reads header fields; every short read or bad value is a ``RecordFormatError``."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview, start: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, start, end

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > self.end:
            raise RecordFormatError(f"record header truncated while reading {what}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        return st.unpack(self.take(st.size, what))


def _as_record_view(record: BytesLike) -> memoryview:
    try:
        buf = memoryview(record)
    except TypeError:
        raise TypeError(f"record must be a bytes-like object, got {type(record).__name__}") from None
    if buf.format != "B" or buf.ndim != 1:
        try:
            buf = buf.cast("B")
        except TypeError:
            raise RecordFormatError("record buffer is not contiguous bytes") from None
    return buf


def _parse(record: BytesLike, total: Optional[int] = None) -> Tuple[RecordHeader, memoryview, int]:
    """Parse and structurally validate; returns (header, record view, payload offset). ``total``:
    the whole record's length when ``record`` holds only its prefix and header (a split read)."""
    buf = _as_record_view(record)
    if total is None:
        total = buf.nbytes
    header_end = header_end_of(buf)
    header_length = header_end - _PREFIX.size
    min_header = _FIXED.size + _U16.size + _U8.size + _CHECKSUM_BYTES
    if header_length < min_header:
        raise RecordFormatError(f"header length {header_length} below the minimum {min_header}")
    if header_end > buf.nbytes:
        raise RecordFormatError(f"record truncated: header needs {header_end} bytes, record has {buf.nbytes}")
    cur = _Cursor(buf, _PREFIX.size, header_end - _CHECKSUM_BYTES)
    (codec_id, esize, ndim, nplanes, group_index, chunk_index, raw_length, payload_length) = cur.unpack(
        _FIXED, "fixed fields"
    )
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None:
        raise RecordFormatError(f"unknown codec id {codec_id}")
    (fp_len,) = cur.unpack(_U16, "fingerprint length")
    if fp_len > MAX_FINGERPRINT_BYTES:
        raise RecordFormatError(f"fingerprint length {fp_len} exceeds {MAX_FINGERPRINT_BYTES}")
    fingerprint = cur.take(fp_len, "fingerprint").tobytes()
    (dt_len,) = cur.unpack(_U8, "dtype length")
    try:
        dtype = cur.take(dt_len, "dtype").tobytes().decode("ascii")
    except UnicodeDecodeError:
        raise RecordFormatError("dtype name is not ASCII") from None
    expected_esize = _ELEMENT_SIZES.get(dtype)
    if expected_esize is None:
        raise RecordFormatError(f"unknown dtype {dtype!r}")
    if esize != expected_esize:
        raise RecordFormatError(f"element size {esize} does not match dtype {dtype} ({expected_esize})")
    if ndim > MAX_NDIM:
        raise RecordFormatError(f"ndim {ndim} exceeds {MAX_NDIM}")
    shape = tuple(cur.unpack(_U64, "shape")[0] for _ in range(ndim))
    planes: List[Tuple[str, int]] = []
    for _ in range(nplanes):
        pc, plen = cur.unpack(_PLANE, "plane table")
        if pc == _PLANE_RAW:
            planes.append((CODEC_RAW, plen))
        elif pc == _PLANE_ZSTD:
            planes.append(("zstd", plen))
        else:
            raise RecordFormatError(f"unknown plane codec id {pc}")
    if cur.pos != cur.end:
        raise RecordFormatError(f"{cur.end - cur.pos} unexpected bytes at the end of the header")
    checksum = buf[header_end - _CHECKSUM_BYTES : header_end].tobytes()

    if codec == CODEC_RAW:
        if nplanes != 0:
            raise RecordFormatError(f"raw codec with {nplanes} planes")
        if payload_length != raw_length:
            raise RecordFormatError(f"raw codec: payload length {payload_length} != raw length {raw_length}")
    else:
        if nplanes != esize:
            raise RecordFormatError(f"{nplanes} planes for a {esize}-byte element")
        if raw_length == 0 or raw_length % esize:
            raise RecordFormatError(f"raw length {raw_length} is not a positive multiple of {esize}")
        plane_raw = raw_length // esize
        if sum(n for _, n in planes) != payload_length:
            raise RecordFormatError("plane lengths do not add up to the payload length")
        for name, plen in planes:
            if name == CODEC_RAW and plen != plane_raw:
                raise RecordFormatError(f"raw plane of {plen} bytes, expected {plane_raw}")
            if name == "zstd" and plen == 0:
                raise RecordFormatError("empty zstd plane")
    if header_end + payload_length != total:
        if header_end + payload_length > total:
            raise RecordFormatError(
                f"payload truncated: header says {payload_length} bytes, record holds {total - header_end}"
            )
        raise RecordFormatError(f"{total - header_end - payload_length} extra bytes after the payload")

    meta = ChunkMeta(
        fingerprint=fingerprint,
        group_index=group_index,
        chunk_index=chunk_index,
        dtype=dtype,
        shape=shape,
    )
    header = RecordHeader(
        meta=meta,
        codec=codec,
        element_size=esize,
        raw_length=raw_length,
        payload_length=payload_length,
        header_length=header_length,
        version=FORMAT_VERSION,
        planes=tuple(planes),
        checksum=checksum,
    )
    return header, buf, header_end


def read_header(record: BytesLike) -> RecordHeader:
    """Parse and validate a record's structure (prefix, header, lengths) without decoding the payload
    or verifying the checksum. Raises ``RecordFormatError`` (a ``CorruptRecordError``)."""
    header, _, _ = _parse(record)
    return header


def header_end_of(prefix: BytesLike) -> int:
    """Where a record's payload starts, from its first ``_PREFIX.size`` (10) bytes alone: what a
    reader of a file needs to read the header and the payload separately. Checks magic, version and
    the header-length cap; raises ``RecordFormatError``."""
    buf = memoryview(prefix)
    if buf.nbytes < _PREFIX.size:
        raise RecordFormatError(f"record too short ({buf.nbytes} bytes) for its {_PREFIX.size}-byte prefix")
    magic, version, header_length = _PREFIX.unpack(buf[: _PREFIX.size])
    if magic != MAGIC:
        raise RecordFormatError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RecordFormatError(f"unknown record format version {version} (this kvtier reads {FORMAT_VERSION})")
    if header_length > MAX_HEADER_BYTES:
        raise RecordFormatError(f"header length {header_length} exceeds the {MAX_HEADER_BYTES}-byte cap")
    return _PREFIX.size + header_length


def read_head(head: BytesLike, record_length: int) -> RecordHeader:
    """``read_header`` for a split read: ``head`` holds at least the record's prefix and header
    (``header_end_of`` bytes), ``record_length`` is the whole record's length, checked against the
    header's payload length. Raises ``RecordFormatError``."""
    header, _, _ = _parse(head, total=record_length)
    return header


def _validate_split(key: bytes, head: BytesLike, payload: memoryview, max_raw_bytes: int) -> RecordHeader:
    """Structure, size cap and checksum of a record held as its head (prefix + header, exactly) and
    its payload, wherever each lies."""
    header, buf, payload_start = _parse(head, total=memoryview(head).nbytes + payload.nbytes)
    if payload_start != buf.nbytes:
        raise RecordFormatError(f"record head of {buf.nbytes} bytes, its header ends at {payload_start}")
    if header.raw_length > max_raw_bytes:
        raise RecordFormatError(f"raw length {header.raw_length} exceeds the limit of {max_raw_bytes} bytes")
    body = buf[_PREFIX.size : payload_start - _CHECKSUM_BYTES]
    if _checksum(bytes(key), buf[: _PREFIX.size], body, payload) != header.checksum:
        raise RecordChecksumError("record checksum mismatch (corrupt bytes, or stored under another key)")
    return header


def check_payload_in_place(key: bytes, head: BytesLike, out: BytesLike, *, max_raw_bytes: int = 1 << 31) -> ChunkMeta:
    """The checks of ``decode_record`` for a raw-codec record whose payload a reader already placed
    straight into ``out`` (a direct read into the caller's buffer, no intermediate copy); ``head``
    is the record's prefix and header. Raises ``CorruptRecordError`` subclasses (``out`` then holds
    the bad bytes: a miss), ``RecordSizeMismatchError`` when an intact raw record is not of
    ``out``'s size, ``ValueError`` when it is not raw (decode it with ``decode_split``)."""
    target = _as_byte_view(out, "out")
    header = _validate_split(key, head, target, max_raw_bytes)
    if header.codec != CODEC_RAW:
        raise ValueError(f"check_payload_in_place needs a raw record, this one is {header.codec}")
    return header.meta


def _validate(key: bytes, record: BytesLike, max_raw_bytes: int) -> Tuple[RecordHeader, memoryview, int]:
    buf = _as_record_view(record)
    payload_start = header_end_of(buf)
    if payload_start > buf.nbytes:
        raise RecordFormatError(f"record truncated: header needs {payload_start} bytes, record has {buf.nbytes}")
    header = _validate_split(key, buf[:payload_start], buf[payload_start:], max_raw_bytes)
    return header, buf, payload_start


def validate_record(key: bytes, record: BytesLike, *, max_raw_bytes: int = 1 << 31) -> RecordHeader:
    """Check a record's structure, ``raw_length <= max_raw_bytes`` and its checksum, without decoding
    the payload or allocating anything of the chunk's size: what a caller runs before sizing a
    buffer from ``header.raw_length``. Raises a ``CorruptRecordError`` subclass."""
    header, _, _ = _validate(key, record, max_raw_bytes)
    return header


def decode_record(
    key: bytes,
    record: BytesLike,
    out: Optional[BytesLike] = None,
    *,
    expected: Optional[ChunkMeta] = None,
    max_raw_bytes: int = 1 << 31,
) -> Tuple[ChunkMeta, memoryview]:
    """Validate a record fully and decode its chunk bytes.

    With ``out`` (a writable C-contiguous buffer of exactly the raw length, e.g. a host slot), the
    bytes land there and nothing of the chunk's size is allocated; without it a ``bytearray`` is
    allocated only after every check passed. Returns ``(meta, view)`` with ``view`` over the filled
    bytes. Any malformed input raises a ``CorruptRecordError`` subclass (see the module docstring for
    the order of checks); ``out`` is untouched unless the checksum and meta checks passed.
    """
    header, buf, payload_start = _validate(key, record, max_raw_bytes)
    return _decode_checked(header, buf[payload_start:], out, expected)


def decode_split(key: bytes, head: BytesLike, payload: BytesLike, out: Optional[BytesLike] = None, *,
                 max_raw_bytes: int = 1 << 31) -> Tuple[ChunkMeta, memoryview]:
    """``decode_record`` of a record held in two pieces: ``head`` (its prefix and header, exactly)
    and ``payload`` (the rest), as a segment file stores them (payload page-aligned)."""
    view = _as_record_view(payload)
    header = _validate_split(key, head, view, max_raw_bytes)
    return _decode_checked(header, view, out, None)


def _decode_checked(header: RecordHeader, payload: memoryview, out: Optional[BytesLike],
                    expected: Optional[ChunkMeta]) -> Tuple[ChunkMeta, memoryview]:
    """The payload of a validated record into ``out`` (or a fresh buffer)."""
    if expected is not None and header.meta != expected:
        raise RecordMetaMismatchError(f"record describes {header.meta}, expected {expected}")

    if out is None:
        target = memoryview(bytearray(header.raw_length))
    else:
        target = _as_byte_view(out, "out")
        if target.readonly:
            raise ValueError("out must be a writable buffer")
        if target.nbytes != header.raw_length:
            raise RecordSizeMismatchError(
                f"record holds {header.raw_length} bytes, the output buffer has {target.nbytes}"
            )

    if header.codec == CODEC_RAW:
        target[:] = payload
        return header.meta, target

    esize = header.element_size
    plane_raw = header.raw_length // esize
    if esize == 2 and _LITTLE_ENDIAN:
        _decode_two_planes(header, payload, target, plane_raw)
        return header.meta, target
    out_planes = np.frombuffer(target, dtype=np.uint8).reshape(plane_raw, esize) if esize > 1 else None
    pos = 0
    for i, (name, plen) in enumerate(header.planes):
        src = payload[pos : pos + plen]
        pos += plen
        if name == CODEC_RAW:
            if out_planes is None:
                target[:] = src
            else:
                out_planes[:, i] = np.frombuffer(src, dtype=np.uint8)
            continue
        dst = target if out_planes is None else _scratch(plane_raw)
        _decompress_plane(src, dst)
        if out_planes is not None:
            out_planes[:, i] = np.frombuffer(dst, dtype=np.uint8)
    return header.meta, target


def _decode_two_planes(header: RecordHeader, payload: memoryview, target: memoryview, plane_raw: int) -> None:
    """2-byte elements, little-endian host: both planes into scratch (or read in place when stored
    raw), then one vectorised merge ``high << 8 | low`` into ``target`` instead of two strided
    byte writes."""
    scratch = _scratch(2 * plane_raw)
    planes: List[np.ndarray] = []
    pos = 0
    for i, (name, plen) in enumerate(header.planes):
        src = payload[pos : pos + plen]
        pos += plen
        if name == CODEC_RAW:
            planes.append(np.frombuffer(src, dtype=np.uint8))
            continue
        dst = scratch[i * plane_raw : (i + 1) * plane_raw]
        _decompress_plane(src, dst)
        planes.append(np.frombuffer(dst, dtype=np.uint8))
    words = np.frombuffer(target, dtype=np.uint8).view(np.uint16)
    np.left_shift(planes[1], 8, out=words, dtype=np.uint16)
    np.bitwise_or(words, planes[0], out=words)


def _decompress_plane(src: memoryview, dst: memoryview) -> None:
    """Decompress one zstd frame into exactly ``dst``; more or fewer bytes is corruption."""
    try:
        size = zstandard.frame_content_size(src)
    except zstandard.ZstdError as exc:
        raise RecordFormatError(f"bad zstd frame header: {exc}") from exc
    if size != dst.nbytes:
        raise RecordFormatError(f"zstd frame declares {size} bytes, plane holds {dst.nbytes}")
    try:
        reader = _decompressor().stream_reader(src, read_across_frames=False)
        filled = 0
        while filled < dst.nbytes:
            n = reader.readinto(dst[filled:])
            if not n:
                break
            filled += n
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise RecordFormatError(f"zstd plane does not decompress: {exc}") from exc
    if filled != dst.nbytes or extra:
        raise RecordFormatError(f"zstd plane produced {filled}{'+' if extra else ''} bytes, expected {dst.nbytes}")
