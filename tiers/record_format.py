"""The chunk record: the self-describing, checksummed byte string every tier below the host pool stores.

Primitives: ``CodecConfig`` (how to encode), ``encode_record`` (chunk bytes -> record),
``decode_record`` (record -> chunk bytes, straight into a caller's buffer), ``read_header`` (structure
and meta without touching the payload), ``validate_record`` (structure, size cap and checksum, without
decoding or allocating), ``RecordHeader``, and the ``CorruptRecordError`` subclasses
``RecordFormatError``, ``RecordChecksumError``, ``RecordMetaMismatchError``, ``RecordSizeMismatchError``.
All are plain synchronous functions, safe on any thread (zstd contexts and scratch buffers are kept
per thread); tiers call them on their worker threads, never on the event loop.

The layout (a length-prefixed header, then the payload; checksummed with the key) is
``tiers.record_layout``'s; the byte-plane zstd codec of the payload is ``tiers.record_planes``'s.
This module is the one callers import: encoding and decoding built on them, and the format's
public names re-exported.

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
from dataclasses import dataclass
from typing import List, Optional, Tuple

from kvtier.errors import (  # the Record* classes are re-exported from here for one release
    RecordChecksumError,
    RecordFormatError,
    RecordMetaMismatchError,
    RecordSizeMismatchError,
)

from .base import ChunkMeta
from .record_layout import (
    CHECKSUM_BYTES,
    CODEC_IDS,
    CODEC_RAW,
    CODEC_ZSTD_PLANES,
    FORMAT_VERSION,
    MAGIC,
    MAX_FINGERPRINT_BYTES,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    PREFIX,
    U32_MAX,
    U64_MAX,
    BytesLike,
    RecordHeader,
    as_record_view,
    element_size,
    encode_header,
    header_end_of,
    parse_header,
    read_head,
    read_header,
)
from .record_layout import checksum as _checksum
from .record_planes import compress_planes, merge_planes

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


@dataclass(frozen=True)
class CodecConfig:
    """How records are encoded.

    ``level``: zstd level 1..22 (level 1 uses the fast match-finder parameters measured in DESIGN.md:
    min_match 7, search_log 1, hash_log 6). ``min_savings_fraction``: keep the compressed form only
    if it is at least this fraction smaller than raw (0 <= f < 1). ``compress``: False stores raw.
    Immutable: any thread.
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


def _check_meta_for_encode(meta: ChunkMeta) -> int:
    if not isinstance(meta, ChunkMeta):
        raise TypeError(f"meta must be a ChunkMeta, got {type(meta).__name__}")
    if not isinstance(meta.fingerprint, (bytes, bytearray)) or len(meta.fingerprint) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"meta.fingerprint must be bytes of at most {MAX_FINGERPRINT_BYTES} bytes")
    if not 0 <= meta.group_index <= U32_MAX:
        raise ValueError(f"meta.group_index out of range: {meta.group_index}")
    if not 0 <= meta.chunk_index <= U64_MAX:
        raise ValueError(f"meta.chunk_index out of range: {meta.chunk_index}")
    if len(meta.shape) > MAX_NDIM or any(not 0 <= int(d) <= U64_MAX for d in meta.shape):
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

    codec_id = CODEC_IDS[CODEC_RAW]
    plane_table: List[Tuple[int, int]] = []
    payload_parts: List[BytesLike] = [view]
    if config.compress and raw_length > 0 and raw_length % esize == 0:
        table, stored = compress_planes(view, esize, config.level)
        total = sum(n for _, n in table)
        if total <= raw_length * (1.0 - float(config.min_savings_fraction)) and total < raw_length:
            codec_id = CODEC_IDS[CODEC_ZSTD_PLANES]
            plane_table = table
            payload_parts = stored

    payload_length = sum(memoryview(p).nbytes for p in payload_parts)
    body = encode_header(key, meta, codec_id, esize, raw_length, plane_table, payload_length)
    header_length = len(body) + CHECKSUM_BYTES
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, header_length)
    return [prefix, body, _checksum(key, prefix, body, *payload_parts), *payload_parts]


def _validate_split(key: bytes, head: BytesLike, payload: memoryview, max_raw_bytes: int) -> RecordHeader:
    """Structure, size cap and checksum of a record held as its head (prefix + header, exactly) and
    its payload, wherever each lies."""
    header, buf, payload_start = parse_header(head, total=memoryview(head).nbytes + payload.nbytes)
    if payload_start != buf.nbytes:
        raise RecordFormatError(f"record head of {buf.nbytes} bytes, its header ends at {payload_start}")
    if header.raw_length > max_raw_bytes:
        raise RecordFormatError(f"raw length {header.raw_length} exceeds the limit of {max_raw_bytes} bytes")
    body = buf[PREFIX.size : payload_start - CHECKSUM_BYTES]
    if _checksum(bytes(key), buf[: PREFIX.size], body, payload) != header.checksum:
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
    buf = as_record_view(record)
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
    view = as_record_view(payload)
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

    merge_planes(header.planes, header.element_size, header.raw_length, payload, target)
    return header.meta, target
