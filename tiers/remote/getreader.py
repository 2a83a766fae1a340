"""Pipelined ``GET`` reads that land each value's payload straight in the caller's buffer.

Primitives: ``GetConnection`` (one socket to one node, an ``asyncio.BufferedProtocol``; runs on the
event-loop thread), ``LiveReads`` (one batch's connections, to stop them at once), ``DirectValue``
(a value whose payload is already in its buffer), and ``decode_into`` / ``fetched_size`` (plain
functions, any thread: the record checks of a fetched value, as ``decode_record`` does them).

Why: redis-py's asyncio client reads through a ``StreamReader`` (``bytearray.extend``, then
``readexactly`` slices, then the record decode copies again), which kept the remote get far below
the socket's speed. Here the kernel's ``recv_into`` writes each ``GET`` reply's record payload into
the caller's buffer: only the RESP header line and the record's prefix and header pass through a
small line buffer. A reply is read this way only when the record is well formed so far and its
payload is exactly the buffer's size (a raw record of the right chunk); any other value (compressed,
short, malformed, another size) is read whole into a ``bytearray`` and decoded as before, and an
error reply (``MOVED``, ``ASK``, ...) becomes the same exception object redis-py makes of it.
"""

from __future__ import annotations

import asyncio
from typing import List, Optional, Sequence, Set, Union

from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError

from kvtier.errors import CorruptRecordError

from ..base import ChunkMeta
from ..record_format import check_payload_in_place, decode_record, decode_split, header_end_of

__all__ = ["GetConnection", "DirectValue", "Reply", "LiveReads", "decode_into", "fetched_size"]

_PREFIX_BYTES = 10  # the record's magic | version | header length (see record_format)
_LINE_BYTES = 64 << 10
_DIRECT_MIN_BYTES = 16 << 10


class DirectValue:
    """A ``GET`` value whose record payload sits in the caller's buffer; ``head`` is the record's
    prefix and header (exactly), for ``check_payload_in_place`` / ``decode_split``. Made on the
    event-loop thread, read by the codec threads after the read finished."""

    __slots__ = ("head",)

    def __init__(self, head: bytearray) -> None:
        self.head = head


Reply = Union[None, bytearray, DirectValue, BaseException]


class LiveReads:
    """The connections reading one batch's values into its buffers, and whether the batch was
    abandoned (its caller cancelled): ``abandon`` aborts those reading and bars any later one.
    Event-loop thread only."""

    __slots__ = ("connections", "abandoned")

    def __init__(self) -> None:
        self.connections: Set["GetConnection"] = set()
        self.abandoned = False

    def abandon(self) -> None:
        """Synchronous: once it returns, nothing of this batch writes into its buffers."""
        self.abandoned = True
        while self.connections:
            self.connections.pop().abort()


def decode_into(rkey: bytes, data: Union[bytes, bytearray, DirectValue], buf: memoryview) -> ChunkMeta:
    """Check and decode one fetched value into ``buf``: a whole record (``decode_record``), or a
    ``DirectValue`` whose payload the reader already placed in ``buf`` (checked in place when raw;
    another codec whose stored size happens to match is decoded from a copy)."""
    if not isinstance(data, DirectValue):
        return decode_record(rkey, data, buf)[0]
    try:
        return check_payload_in_place(rkey, data.head, buf)
    except ValueError:
        return decode_split(rkey, data.head, bytes(buf), buf)[0]


def fetched_size(data: Union[bytes, bytearray, DirectValue], buf: memoryview) -> int:
    """The record's length of a fetched value."""
    return len(data.head) + buf.nbytes if isinstance(data, DirectValue) else len(data)


class GetConnection(asyncio.BufferedProtocol):
    """One connection reading pipelined ``GET`` replies. One pipeline at a time (``get``), on the
    event-loop thread only (asyncio calls its protocol methods there)."""

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self._line = bytearray(_LINE_BYTES)
        self._lpos = 0  # bytes held in the line buffer
        self._cur: Optional[memoryview] = None  # the value part being filled (body state)
        self._pos = 0
        self._stage = 0  # 1 prefix, 2 rest of head, 3 payload (direct), 4 whole value, 5 CRLF
        self._n = 0
        self._head: Optional[bytearray] = None
        self._whole: Optional[bytearray] = None
        self._crlf = bytearray(2)
        self._targets: Sequence[memoryview] = ()
        self._replies: List[Reply] = []
        self._done: Optional["asyncio.Future[List[Reply]]"] = None
        self._expect = 0
        self._direct = False
        self._pending: Reply = None
        self.broken: Optional[BaseException] = None

    # ----------------------------------------------------------------------------- protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._fail(RedisConnectionError(f"connection closed by the server{': ' + str(exc) if exc else ''}"))

    def eof_received(self) -> Optional[bool]:
        self._fail(RedisConnectionError("connection closed by the server"))
        return False

    def get_buffer(self, sizehint: int) -> memoryview:
        # Big parts (payloads) are read straight into place; small ones (a record's head, the CRLF
        # after a value, the next reply's line) through the line buffer, many per recv.
        cur = self._cur
        self._direct = cur is not None and self._lpos == 0 and cur.nbytes - self._pos >= _DIRECT_MIN_BYTES
        if self._direct:
            return cur[self._pos:]  # type: ignore[index]
        return memoryview(self._line)[self._lpos:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct:
                self._pos += nbytes
                if self._pos == self._cur.nbytes:  # type: ignore[union-attr]  # set whenever _direct is
                    self._next_stage()
                return
            self._lpos += nbytes
            self._drain_line()
        except _ProtocolError as exc:
            self._fail(RedisConnectionError(f"bad reply from the server: {exc}"))
            if self.transport is not None:
                self.transport.abort()

    # ------------------------------------------------------------------------------- public

    async def get(self, names: Sequence[bytes], targets: Sequence[memoryview]) -> List[Reply]:
        """Send ``GET name`` for each name and read the replies; a raw record of ``targets[i]``'s
        size lands straight in ``targets[i]`` (``DirectValue``). Raises redis-py's
        ``ConnectionError`` when the connection breaks (then it is unusable). Cancelling it leaves
        the connection mid-reply: the caller must ``abort`` it (which stops every write at once)."""
        if self.broken is not None:
            raise self.broken
        assert self._done is None, "one pipeline at a time"
        self._targets = targets
        self._replies = []
        self._expect = len(names)
        self._done = asyncio.get_running_loop().create_future()
        out = bytearray()
        for name in names:
            out += b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name)
        assert self.transport is not None
        self.transport.write(out)
        if not names:
            self._finish()
        try:
            replies = await self._done
        except BaseException:
            self.abort()  # mid-reply: unusable, and nothing may write into the targets any more
            raise
        finally:
            self._done = None
            self._targets = ()
        if self._lpos or self._cur is not None:
            self.abort()  # bytes beyond the replies asked for: the stream is out of step
        return replies

    def abort(self) -> None:
        """Drop the connection now (no further reads into any buffer)."""
        self._targets = ()
        self._cur = None
        if self.transport is not None:
            self.transport.abort()
        self._fail(RedisConnectionError("connection aborted"))

    # ------------------------------------------------------------------------------ parsing

    def _fail(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
        self._cur = None
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    def _finish(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(self._replies)

    def _add(self, reply: Reply) -> None:
        if self._done is None:
            raise _ProtocolError("a reply nobody asked for")
        self._replies.append(reply)
        if len(self._replies) == self._expect:
            self._finish()

    def _drain_line(self) -> None:
        """Consume what sits in the line buffer: header lines, and body bytes that came with them."""
        line = self._line
        start = 0
        while start < self._lpos:
            if self._cur is not None:
                take = min(self._lpos - start, self._cur.nbytes - self._pos)
                self._cur[self._pos:self._pos + take] = line[start:start + take]
                self._pos += take
                start += take
                if self._pos == self._cur.nbytes:
                    self._next_stage()
                continue
            end = line.find(b"\r\n", start, self._lpos)
            if end < 0:
                if start == 0 and self._lpos == len(line):
                    raise _ProtocolError("reply line longer than the line buffer")
                break
            kind = line[start:start + 1]
            text = bytes(line[start + 1:end])
            start = end + 2
            if kind == b"$":
                n = int(text)
                if n < 0:
                    self._add(None)
                else:
                    self._begin_value(n)
            elif kind == b"-":
                self._add(BaseParser.parse_error(text.decode("utf-8", "replace")))
            else:
                raise _ProtocolError(f"unexpected reply type {bytes(kind)!r} to GET")
        rest = self._lpos - start
        if rest:
            line[:rest] = line[start:self._lpos]
        self._lpos = rest

    def _begin_value(self, n: int) -> None:
        self._n = n
        if n < _PREFIX_BYTES:
            self._whole = bytearray(n)
            self._set(memoryview(self._whole), 4)
            return
        self._head = bytearray(_PREFIX_BYTES)
        self._set(memoryview(self._head), 1)

    def _set(self, view: memoryview, stage: int) -> None:
        self._cur, self._pos, self._stage = view, 0, stage
        if view.nbytes == 0:
            self._next_stage()

    def _next_stage(self) -> None:
        stage = self._stage
        if stage == 1:
            head = self._head
            assert head is not None
            try:
                hend = header_end_of(head)
            except CorruptRecordError:
                hend = -1
            index = len(self._replies)
            target = self._targets[index] if index < len(self._targets) else None
            if (hend < _PREFIX_BYTES or hend > self._n or target is None
                    or self._n - hend != target.nbytes):
                self._whole = bytearray(self._n)
                self._whole[:_PREFIX_BYTES] = head
                self._head = None
                whole = memoryview(self._whole)
                self._set(whole[_PREFIX_BYTES:], 4)
                return
            full = bytearray(hend)
            full[:_PREFIX_BYTES] = head
            self._head = full
            self._set(memoryview(full)[_PREFIX_BYTES:], 2)
        elif stage == 2:
            index = len(self._replies)
            self._set(self._targets[index], 3)
        elif stage in (3, 4):
            if stage == 3:
                assert self._head is not None
                reply: Reply = DirectValue(self._head)
            else:
                reply = self._whole
            self._head = self._whole = None
            self._pending = reply
            self._set(memoryview(self._crlf), 5)
        elif stage == 5:
            self._cur = None
            self._stage = 0
            if self._crlf != b"\r\n":
                raise _ProtocolError("bulk string not followed by CRLF")
            reply, self._pending = self._pending, None
            self._add(reply)


class _ProtocolError(Exception):
    pass
