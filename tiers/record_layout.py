"""The chunk record's layout: constants, the header's encoding and parsing, and the checksum.

Primitives: ``RecordHeader`` (what a header says), ``encode_header`` (the header's fields as bytes),
``checksum`` (XXH3-128 over key, prefix, header and payload), ``parse_header`` (prefix and header
structurally validated, before any allocation of the chunk's size), ``header_end_of`` /
``read_header`` / ``read_head``, ``element_size``, and the format's constants. Plain functions,
safe on any thread. ``tiers.record_format`` builds encoding and decoding on them and is the
module callers import.

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
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import xxhash

from kvtier.errors import RecordFormatError

from .base import ChunkMeta

__all__ = [
    "RecordHeader", "encode_header", "checksum", "parse_header", "header_end_of", "read_header",
    "read_head", "as_record_view", "element_size", "BytesLike", "MAGIC", "FORMAT_VERSION",
    "MAX_HEADER_BYTES", "MAX_NDIM", "MAX_FINGERPRINT_BYTES", "CODEC_RAW", "CODEC_ZSTD_PLANES",
    "CODEC_IDS", "PLANE_RAW", "PLANE_ZSTD", "PREFIX", "CHECKSUM_BYTES", "U32_MAX", "U64_MAX",
    "LITTLE_ENDIAN", "ELEMENT_SIZES",
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
CODEC_IDS = {CODEC_RAW: 0, CODEC_ZSTD_PLANES: 1}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
PLANE_RAW = 0
PLANE_ZSTD = 1

PREFIX = struct.Struct("<4sHI")
FIXED = struct.Struct("<BBBBIQQQ")
U16 = struct.Struct("<H")
U8 = struct.Struct("<B")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
PLANE = struct.Struct("<BQ")
CHECKSUM_BYTES = 16
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
LITTLE_ENDIAN = sys.byteorder == "little"

# Bytes per element of the dtypes a KV cache uses (torch names without "torch.").
ELEMENT_SIZES: Dict[str, int] = {
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
        return ELEMENT_SIZES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; known: {', '.join(sorted(ELEMENT_SIZES))}"
        ) from None


@dataclass(frozen=True)
class RecordHeader:
    """What ``read_header`` finds in a record (the payload is not decoded, the checksum not checked).
    Immutable: any thread."""

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
        return PREFIX.size + self.header_length + self.payload_length


def encode_header(
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
        FIXED.pack(
            codec_id,
            esize,
            len(meta.shape),
            len(planes),
            meta.group_index,
            meta.chunk_index,
            raw_length,
            payload_length,
        ),
        U16.pack(len(fp)),
        fp,
        U8.pack(len(dt)),
        dt,
    ]
    parts.extend(U64.pack(d) for d in meta.shape)
    parts.extend(PLANE.pack(c, n) for c, n in planes)
    return b"".join(parts)


# python-xxhash releases the GIL for an update of more than 64 KiB. Hashing is far quicker than
# the wait to take the GIL back in a process whose other threads keep it busy (a serving
# process's scheduler and tokenizer): 1 MiB hashes in about 0.03 ms, and each return waited
# 10-15 ms beside two CPU-bound threads. So a payload is hashed in slices no update releases for.
HASH_SLICE_BYTES = 64 << 10


def checksum(key: BytesLike, prefix: BytesLike, header_body: BytesLike, *payload: BytesLike) -> bytes:
    """The record's checksum (module docstring); the payload may come in parts, in order. Holds
    the GIL throughout (about 30 us a MiB)."""
    h = xxhash.xxh3_128()
    h.update(U32.pack(len(key)))
    h.update(key)
    h.update(prefix)
    h.update(header_body)
    for part in payload:
        view = memoryview(part)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        for start in range(0, view.nbytes, HASH_SLICE_BYTES):
            h.update(view[start : start + HASH_SLICE_BYTES])
    return h.digest()


class _Cursor:
    """Reads header fields; every short read or bad value is a ``RecordFormatError``. One parse on
    one thread (made and dropped inside ``parse_header``)."""

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


def as_record_view(record: BytesLike) -> memoryview:
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


def parse_header(record: BytesLike, total: Optional[int] = None) -> Tuple[RecordHeader, memoryview, int]:
    """Parse and structurally validate; returns (header, record view, payload offset). ``total``:
    the whole record's length when ``record`` holds only its prefix and header (a split read)."""
    buf = as_record_view(record)
    if total is None:
        total = buf.nbytes
    header_end = header_end_of(buf)
    header_length = header_end - PREFIX.size
    min_header = FIXED.size + U16.size + U8.size + CHECKSUM_BYTES
    if header_length < min_header:
        raise RecordFormatError(f"header length {header_length} below the minimum {min_header}")
    if header_end > buf.nbytes:
        raise RecordFormatError(f"record truncated: header needs {header_end} bytes, record has {buf.nbytes}")
    cur = _Cursor(buf, PREFIX.size, header_end - CHECKSUM_BYTES)
    (codec_id, esize, ndim, nplanes, group_index, chunk_index, raw_length, payload_length) = cur.unpack(
        FIXED, "fixed fields"
    )
    codec = CODEC_NAMES.get(codec_id)
    if codec is None:
        raise RecordFormatError(f"unknown codec id {codec_id}")
    (fp_len,) = cur.unpack(U16, "fingerprint length")
    if fp_len > MAX_FINGERPRINT_BYTES:
        raise RecordFormatError(f"fingerprint length {fp_len} exceeds {MAX_FINGERPRINT_BYTES}")
    fingerprint = cur.take(fp_len, "fingerprint").tobytes()
    (dt_len,) = cur.unpack(U8, "dtype length")
    try:
        dtype = cur.take(dt_len, "dtype").tobytes().decode("ascii")
    except UnicodeDecodeError:
        raise RecordFormatError("dtype name is not ASCII") from None
    expected_esize = ELEMENT_SIZES.get(dtype)
    if expected_esize is None:
        raise RecordFormatError(f"unknown dtype {dtype!r}")
    if esize != expected_esize:
        raise RecordFormatError(f"element size {esize} does not match dtype {dtype} ({expected_esize})")
    if ndim > MAX_NDIM:
        raise RecordFormatError(f"ndim {ndim} exceeds {MAX_NDIM}")
    shape = tuple(cur.unpack(U64, "shape")[0] for _ in range(ndim))
    planes: List[Tuple[str, int]] = []
    for _ in range(nplanes):
        pc, plen = cur.unpack(PLANE, "plane table")
        if pc == PLANE_RAW:
            planes.append((CODEC_RAW, plen))
        elif pc == PLANE_ZSTD:
            planes.append(("zstd", plen))
        else:
            raise RecordFormatError(f"unknown plane codec id {pc}")
    if cur.pos != cur.end:
        raise RecordFormatError(f"{cur.end - cur.pos} unexpected bytes at the end of the header")
    stored_checksum = buf[header_end - CHECKSUM_BYTES : header_end].tobytes()

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

    meta = ChunkMeta(fingerprint, group_index, chunk_index, dtype, shape)
    header = RecordHeader(meta, codec, esize, raw_length, payload_length, header_length, FORMAT_VERSION,
                          tuple(planes), stored_checksum)
    return header, buf, header_end


def read_header(record: BytesLike) -> RecordHeader:
    """Parse and validate a record's structure (prefix, header, lengths) without decoding the payload
    or verifying the checksum. Raises ``RecordFormatError`` (a ``CorruptRecordError``)."""
    header, _, _ = parse_header(record)
    return header


def header_end_of(prefix: BytesLike) -> int:
    """Where a record's payload starts, from its first ``PREFIX.size`` (10) bytes alone: what a
    reader of a file needs to read the header and the payload separately. Checks magic, version and
    the header-length cap; raises ``RecordFormatError``."""
    buf = memoryview(prefix)
    if buf.nbytes < PREFIX.size:
        raise RecordFormatError(f"record too short ({buf.nbytes} bytes) for its {PREFIX.size}-byte prefix")
    magic, version, header_length = PREFIX.unpack(buf[: PREFIX.size])
    if magic != MAGIC:
        raise RecordFormatError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RecordFormatError(f"unknown record format version {version} (this kvtier reads {FORMAT_VERSION})")
    if header_length > MAX_HEADER_BYTES:
        raise RecordFormatError(f"header length {header_length} exceeds the {MAX_HEADER_BYTES}-byte cap")
    return PREFIX.size + header_length


def read_head(head: BytesLike, record_length: int) -> RecordHeader:
    """``read_header`` for a split read: ``head`` holds at least the record's prefix and header
    (``header_end_of`` bytes), ``record_length`` is the whole record's length, checked against the
    header's payload length. Raises ``RecordFormatError``."""
    header, _, _ = parse_header(head, total=record_length)
    return header
