"""The contract every byte-holding tier below the host pool keeps (LMDB disk, file-per-chunk, remote).

Primitives: ``ChunkTier`` (the async facade the engine drives), ``ChunkMeta`` (what a record says
about its chunk), ``Removal`` / ``KeySnapshot`` (what the engine orders its index by),
``TierStatistics`` (one typed record, the same field names for every tier), ``check_key`` (the one
key rule), ``RemovalFeed`` (hands removal reports to subscribers' loops), ``IOHook`` (the
fault-injection point under a tier's low-level operations); for implementations, ``Forwarded``
(a facade's attribute read from the part that owns it) and ``wait_for_gate`` (the wait of a
two-phase put).

Methods are called from the event-loop thread; implementations do their blocking work on their own
threads and hand results back with ``loop.call_soon_threadsafe``. A new tier is correct when it
passes ``tests/integration/test_tier_contract.py`` (add it to that module's ``TIERS``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from dataclasses import dataclass, field, fields
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    FrozenSet,
    Generic,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    overload,
)

from kvtier.errors import TierIOError

if TYPE_CHECKING:
    from .lru import ByteLru

__all__ = [
    "ChunkMeta",
    "ChunkTier",
    "PutAbortedError",
    "StartedPut",
    "PutItem",
    "GetItem",
    "IOHook",
    "NO_IO_HOOK",
    "Forwarded",
    "wait_for_gate",
    "Removal",
    "RemovalCallback",
    "RemovalFeed",
    "KeySnapshot",
    "TierStatistics",
    "REMOVAL_REASONS",
    "KEY_MAX_BYTES",
    "check_key",
]

log = logging.getLogger(__name__)

# The longest key every tier stores: LMDB's key limit. The file tier nests the hex of a long key
# over several directory levels to stay inside NAME_MAX.
KEY_MAX_BYTES = 511

REMOVAL_REASONS = ("evicted", "quarantined", "deleted", "external")


def check_key(key: object) -> bytes:
    """The one key rule: ``bytes`` of length 1..``KEY_MAX_BYTES``. Returns the key; raises
    ``TypeError`` for another type and ``ValueError`` naming the length otherwise."""
    if not isinstance(key, bytes):
        raise TypeError(f"chunk keys are bytes, not {type(key).__name__}")
    if not 0 < len(key) <= KEY_MAX_BYTES:
        raise ValueError(f"chunk key length must be 1..{KEY_MAX_BYTES}, got {len(key)}")
    return key


@dataclass(frozen=True)
class ChunkMeta:
    """What a record binds besides its bytes: checked on every read, so a record written for another
    model layout, group or chunk is never returned for this one.

    ``dtype`` is the torch dtype name without the ``torch.`` prefix (``"bfloat16"``); ``shape`` is the
    logical shape of the chunk's bytes as the device view lays them out.
    """

    fingerprint: bytes
    group_index: int
    chunk_index: int
    dtype: str
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Removal:
    """A record stopped being readable. ``sequence``: the tier's mutation sequence at which it did;
    ``reason``: ``"evicted"`` (capacity), ``"quarantined"`` (found corrupt), ``"deleted"``
    (``delete_many``, or a failed put that had already replaced the old record), ``"external"``
    (found gone: removed by another process or by hand)."""

    key: bytes
    sequence: int
    reason: str


@dataclass(frozen=True)
class KeySnapshot:
    """The keys a tier held at ``sequence``: every mutation with a sequence <= it is reflected in
    ``keys``, none later."""

    keys: FrozenSet[bytes]
    sequence: int


@dataclass(frozen=True)
class TierStatistics:
    """Counters of one tier, the same names for every tier (items, not batches, unless named).

    ``records`` / ``bytes``: what the tier holds now (encoded bytes); ``capacity_bytes``: its bound
    (``None``: only the medium bounds it). ``puts`` / ``gets`` / ``hits`` / ``misses``: items;
    ``put_batches``: ``put_many`` calls that landed. ``corrupt``: records that failed their checksum
    or did not parse on a read; ``mismatched``: intact records of another size than the caller's
    buffer (misses, left in place); ``quarantined``: records this instance took out of service as
    corrupt; ``evictions``: records dropped for capacity; ``deletes``: records ``delete_many``
    removed; ``errors``: failed operations underneath; ``degraded``: a write failed underneath and
    no write has succeeded since. ``extra``: tier-specific counters (``map_size_bytes``,
    ``temps_removed``, ``injected_faults``, ...).
    """

    records: int = 0
    bytes: int = 0
    capacity_bytes: Optional[int] = None
    puts: int = 0
    put_batches: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    mismatched: int = 0
    quarantined: int = 0
    evictions: int = 0
    deletes: int = 0
    errors: int = 0
    degraded: bool = False
    extra: Mapping[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, float]:
        """Every counter as a flat float (``capacity_bytes`` 0 for none, ``degraded`` 1.0 / 0.0),
        ``extra`` merged in: for metrics exporters and the CLI."""
        out: Dict[str, float] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            out[f.name] = float(value or 0)
        for name, value in self.extra.items():
            out[name] = float(value)
        return out

    @classmethod
    def from_counters(
        cls, counters: Mapping[str, float], index: "ByteLru", *, capacity_bytes: Optional[int], degraded: bool,
        **extra: float,
    ) -> "TierStatistics":
        """Build a tier's record from its counter table (names of fields go to the fields, the rest
        to ``extra``), its byte index (``records``, ``bytes``) and ``extra`` values."""
        shared = {name: int(value) for name, value in counters.items() if name in _COUNTER_FIELDS}
        rest = {name: float(value) for name, value in counters.items() if name not in _COUNTER_FIELDS}
        rest.update(extra)
        return cls(records=len(index), bytes=index.total_bytes, capacity_bytes=capacity_bytes,
                   degraded=degraded, extra=rest, **shared)

    def with_extra(self, **extra: float) -> "TierStatistics":
        """A copy with more tier-specific counters (a wrapper adding its own)."""
        merged = dict(self.extra)
        merged.update(extra)
        return TierStatistics(**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}, extra=merged)


STATISTICS_FIELDS: Tuple[str, ...] = tuple(f.name for f in fields(TierStatistics))
# The fields a tier counts itself (the rest come from its index, its configuration and its state).
_COUNTER_FIELDS = frozenset(STATISTICS_FIELDS) - {"records", "bytes", "capacity_bytes", "degraded", "extra"}

RemovalCallback = Callable[[Sequence[Removal]], None]


class RemovalFeed:
    """Delivers a tier's removal reports to its subscribers, each on the event loop that was running
    when it subscribed (``call_soon_threadsafe``; the callback itself runs on that loop's thread).
    ``publish`` may be called from any thread. A subscriber that subscribed outside a loop is called
    on the publishing thread. A subscriber whose loop has closed is dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: List[Tuple[Optional[asyncio.AbstractEventLoop], RemovalCallback]] = []

    def subscribe(self, callback: RemovalCallback) -> None:
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        try:
            loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._subscribers.append((loop, callback))

    def publish(self, removals: Sequence[Removal]) -> None:
        if not removals:
            return
        batch = tuple(removals)
        with self._lock:
            subscribers = list(self._subscribers)
        for loop, callback in subscribers:
            if loop is None:
                _call_logged(callback, batch)
                continue
            try:
                loop.call_soon_threadsafe(_call_logged, callback, batch)
            except RuntimeError:  # its loop is closed: nobody is listening any more
                with self._lock:
                    if (loop, callback) in self._subscribers:
                        self._subscribers.remove((loop, callback))


def _call_logged(callback: RemovalCallback, removals: Sequence[Removal]) -> None:
    try:
        callback(removals)
    except Exception:
        log.exception("kvtier: removal subscriber %r failed", callback)


class IOHook:
    """Called by a tier right before each of its low-level operations; the default does nothing.

    The LMDB tier names its operations ``"put"`` (one record into a write transaction), ``"commit"``
    and ``"read"`` (a read transaction); the file tier ``"mkdir"``, ``"open"``, ``"write"``,
    ``"fsync"``, ``"rename"``, ``"fsync_dir"``, ``"read"`` and ``"remove"``. ``before(op)`` runs on
    whichever thread is about to do the operation (the event loop, an I/O thread, the LMDB writer).
    An exception raised there is, to the tier, that operation failing: the fault suite installs a
    hook that raises the error the real call would raise (``kvtier.tools.testing.faults.inject_io_faults``).
    """

    __slots__ = ()

    def before(self, op: str) -> None:
        return None


NO_IO_HOOK = IOHook()

T = TypeVar("T")


class Forwarded(Generic[T]):
    """A tier facade's attribute that is ``name`` of the part the facade holds in ``part``: read
    through (and, with ``settable``, written through), so the value has one owner. Any thread the
    part allows."""

    def __init__(self, part: str, name: str, *, settable: bool = False, doc: Optional[str] = None) -> None:
        self._part = part
        self._name = name
        self._settable = settable
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, objtype: Optional[type] = None) -> "Forwarded[T]": ...

    @overload
    def __get__(self, obj: object, objtype: Optional[type] = None) -> T: ...

    def __get__(self, obj: object, objtype: Optional[type] = None) -> "Union[T, Forwarded[T]]":
        if obj is None:
            return self
        return getattr(getattr(obj, self._part), self._name)

    def __set__(self, obj: object, value: T) -> None:
        if not self._settable:
            raise AttributeError(f"{self._name} is read-only")
        setattr(getattr(obj, self._part), self._name, value)


async def wait_for_gate(after: "Optional[asyncio.Future[Any]]", what: str) -> None:
    """The wait of a two-phase put (``ChunkTier.start_put``): return once ``after`` (if any) has
    succeeded; raise ``PutAbortedError`` naming ``what`` was dropped if it failed or was
    cancelled. Cancelling the wait cancels only the wait (``after`` is shielded)."""
    if after is None:
        return
    try:
        await asyncio.shield(after)
    except BaseException as exc:  # the write this one follows failed: store nothing
        raise PutAbortedError(f"{what} dropped: the write it follows failed ({exc!r})") from exc


class PutAbortedError(TierIOError):
    """A ``start_put(after=...)`` batch was dropped unsent because the write it follows failed."""


# (key, meta, raw bytes of the chunk): the tier encodes and writes; the caller keeps the buffer
# unchanged until put_many has ended (see the buffer rule in ChunkTier).
PutItem = Tuple[bytes, ChunkMeta, memoryview]
# (key, writable buffer of exactly the chunk's raw size): the tier decodes straight into it.
GetItem = Tuple[bytes, memoryview]
# What ``ChunkTier.start_put`` returns: a future done once the caller's buffers are no longer read,
# and the task that lands the batch (its result the sequence, its exception the failure).
StartedPut = Tuple["asyncio.Future[Any]", "asyncio.Future[int]"]


class ChunkTier(abc.ABC):
    """An async store of encoded chunk records (see ``tiers.record_format``) keyed by chunk keys.

    Rules every tier keeps (``tests/integration/test_tier_contract.py`` checks each):

    - Keys: ``bytes`` of 1..``KEY_MAX_BYTES`` bytes (``check_key``): ``TypeError`` for another type,
      ``ValueError`` naming the length, before anything is done.
    - Errors: ``TierFullError`` (no room), ``TierIOError`` (broken underneath; the tier is then
      ``degraded`` until a write succeeds), ``ClosedError`` (closed). A corrupt record is never an
      error to the reader: it is a miss, quarantined, counted (``corrupt``, ``quarantined``) and
      reported as ``Removal(reason="quarantined")``.
    - Cancellation rule, the same for every async method: cancelling the caller cancels only its
      wait; work already handed to the tier runs to completion (a put still lands all or nothing,
      a delete still happens).
    - Buffer rule: no call returns or raises -- even when cancelled -- while the tier may still read
      from or write into a buffer the caller passed (``put_many``: until encoding has read the raw
      buffers; ``get_many_into``: until decoding into the buffers is finished or abandoned for
      good). Once the call has ended the caller may reuse its buffers; a cancelled call re-raises
      ``CancelledError`` at that point.
    - Sequences: every mutation (a put batch landing, a removal of any kind) has a sequence number,
      increasing per tier. If ``Removal(key, s)`` is reported and a ``put_many`` that wrote ``key``
      returned ``p``, the key is readable iff ``p > s`` (the later mutation wins). A
      ``KeySnapshot(keys, s)`` reflects every put and removal with a sequence <= ``s``.
    - Removals: every record that stops being readable for any reason (capacity eviction,
      quarantine, ``delete_many``, a failed put that had replaced it, found gone) is reported once
      to every ``subscribe_removals`` callback.
    """

    name: str = "tier"
    # What the default ``degraded`` / ``capacity_bytes`` / ``closed`` report; a tier sets them in
    # ``__init__`` (and ``_closed`` when it closes).
    _degraded: bool = False
    _capacity: Optional[int] = None
    _closed: bool = False

    # --------------------------------------------------------------------------------- required

    @abc.abstractmethod
    async def put_many(self, items: Sequence[PutItem]) -> int:
        """Store a batch; durable when it returns; all or nothing (on error no item is visible).
        Returns the sequence number of the mutation that made the batch visible. Duplicate keys in
        one batch: the last one wins. Cancellation and buffers: see the class docstring."""

    @abc.abstractmethod
    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Decode each record straight into its buffer; per item the record's meta, or ``None`` on
        a miss (absent; corrupt: quarantined and counted; intact but of another size than the
        buffer: ``mismatched``). Buffers of missed items are unspecified. Cancellation and buffers:
        see the class docstring."""

    @abc.abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove records; returns how many existed; each is reported as ``Removal("deleted")``.
        Cancellation: see the class docstring (the delete still happens)."""

    @abc.abstractmethod
    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Which keys have a record (no checksum check). Cancelling drops the answer only."""

    @abc.abstractmethod
    async def list_keys(self) -> List[bytes]:
        """Every key currently stored. Cancelling drops the answer only."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish queued writes, release resources. Safe to call twice; every later call of another
        method raises ``ClosedError``. Cancelling leaves the tier closing; call it again to wait."""

    @abc.abstractmethod
    def statistics(self) -> TierStatistics:
        """The tier's counters (cheap, sync)."""

    # ---------------------------------------------------------------- optional, with defaults

    async def snapshot_keys(self) -> KeySnapshot:
        """The stored keys with the sequence they reflect. Default: ``sequence`` read first, then
        ``list_keys()`` (so the keys may also reflect later mutations); tiers override it with an
        atomic one. Cancelling drops the answer only."""
        sequence = self.sequence
        return KeySnapshot(frozenset(await self.list_keys()), sequence)

    @property
    def sequence(self) -> int:
        """The last mutation sequence this tier knows of (0: none yet). Default 0."""
        return 0

    def subscribe_removals(self, callback: RemovalCallback) -> None:
        """Call ``callback(removals)`` for every batch of records that stopped being readable, on the
        event loop that is running now (see ``RemovalFeed``). Default: a tier that never drops
        records reports nothing."""

    def subscribe_arrivals(self, callback: Callable[[List[bytes], int], None]) -> None:
        """Call ``callback(keys, sequence)`` on the event loop for keys another writer made readable
        in this tier (a shared remote's new-key notices), at the tier's ``sequence``: a removal of
        one of them reported later has a later sequence. Default: a tier that cannot tell reports
        nothing (a listing finds such keys)."""

    async def flush(self) -> None:
        """Wait until every write queued so far has landed. Default: nothing is queued."""

    async def sync_removals(self) -> None:
        """Wait until every record that stopped being readable before the call, and that this tier
        can learn of without a listing, has been reported to the subscribers (queued on their
        loops): a tier told of removals from elsewhere (a shared server's notices) waits for those
        in flight. Cancelling it stops the wait only. Default: a tier reports its removals as it
        makes them, so there is nothing to wait for."""

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """``keys`` were just used from a faster copy above this tier (the engine's host slab): a
        tier that evicts by recency moves the ones it holds to the young end, as a read of them
        would, so a chunk kept hot above does not age out below and vanish once the copy above is
        evicted. Never blocks, no I/O on the calling thread, unknown keys ignored; event-loop
        thread. Default: nothing (a tier whose evictions are not by recency, or not its own)."""

    async def check(self) -> List[str]:
        """Self-check: one line per problem found (empty when consistent). Default: ``[]``."""
        return []

    @property
    def degraded(self) -> bool:
        """True after a write failed underneath (disk full, I/O error), until a later write
        succeeds; reads keep working meanwhile. Default: ``self._degraded`` (False)."""
        return self._degraded

    @property
    def capacity_bytes(self) -> Optional[int]:
        """The bound on stored bytes (``None``: none but the medium). Default: ``self._capacity``."""
        return self._capacity

    @property
    def closed(self) -> bool:
        """True once ``close`` has begun (every later call but ``close`` raises ``ClosedError``).
        Default: ``self._closed`` (False)."""
        return self._closed

    def start_put(self, items: Sequence[PutItem], *, after: "Optional[asyncio.Future[Any]]" = None) -> StartedPut:
        """The two phases of ``put_many`` apart, for a tier written behind another (the chained
        tier): returns ``(buffers_read, landed)`` at once (see ``StartedPut``). With ``after``,
        nothing lands before that future has succeeded; if it fails or is cancelled, the batch is
        dropped (``landed`` raises ``PutAbortedError``). Event-loop thread; arguments are checked
        before anything starts; the caller owns ``landed`` (the tier does not cancel it).

        Default: a task that waits for ``after`` and then runs ``put_many`` (the buffers are read
        until it ends, so ``buffers_read`` is that task). A tier that can read the buffers first
        (encode) and write later overrides it: the remote tier encodes while the first tier writes."""
        batch = list(items)
        for key, _, _ in batch:
            check_key(key)
        landed = asyncio.ensure_future(self._put_after(batch, after))
        return landed, landed

    async def _put_after(self, items: List[PutItem], after: "Optional[asyncio.Future[Any]]") -> int:
        await wait_for_gate(after, f"{self.name}: store of {len(items)} records")
        return await self.put_many(items)

