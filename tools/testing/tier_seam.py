"""A scriptable seam in front of any tier: fail a call with any exception, hold it, stall it.

Primitives: ``SeamTier`` (wraps a ``ChunkTier``), ``Gate`` (a held call: ``entered`` tells the
test the call reached the seam, ``release()`` lets it go on). Runs on the caller's event loop.

``FaultyTier`` (``kvtier.tools.testing.faults``) fails with kvtier's own ``InjectedFault`` only; the engine's
contract is that *any* exception at a tier boundary (a third-party tier's ``ValueError``, a
``MemoryError``, a ``ConnectionResetError``) is a failure that leaves its states consistent, and
that races between a tier's answer and the engine's bookkeeping are harmless. Tests reach those
paths through this seam:

    seam = SeamTier(inner)
    seam.fail_next("put_many", ValueError("codec: unknown dtype"))
    gate = seam.hold_next("get_many_into", after=True)   # the read lands, its answer waits
    await gate.entered.wait(); ...; gate.release()
    seam.stall("get_many_into")                           # every read waits until heal()

A fault or hold placed "before" the inner call happens before the inner tier saw anything (a
cancelled call then touched no buffer); "after" holds the inner tier's answer, so a test can run
something between a tier's commit and the moment the engine learns of it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from kvtier.tiers.base import ChunkMeta, ChunkTier, GetItem, KeySnapshot, PutItem

from .forwarding import ForwardingTier

__all__ = ["SeamTier", "Gate", "SEAM_OPS"]

SEAM_OPS = ("put_many", "get_many_into", "delete_many", "contains_many", "list_keys")


class Gate:
    """One held tier call: ``entered`` is set when the call reaches the seam; ``release()`` lets it
    continue. Both are event-loop objects."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self._open = asyncio.Event()

    def release(self) -> None:
        self._open.set()

    async def _pass(self) -> None:
        self.entered.set()
        await self._open.wait()


# A scripted action: ("raise", exception, after) | ("hold", Gate, after) | ("delay", seconds, after)
_Action = Tuple[str, Any, bool]


class SeamTier(ForwardingTier):
    """Delegates every call to ``inner`` after running the action scripted for it, if any.

    ``calls`` counts calls per operation; ``faults`` counts the exceptions the seam raised.
    The contract's optional methods (``subscribe_removals``, ``flush``, ``sequence``, ``check``...)
    pass through untouched; ``snapshot_keys`` goes through the seam's ``list_keys``.
    """

    def __init__(self, inner: ChunkTier) -> None:
        super().__init__(inner, prefix="seam")
        self._scripts: Dict[str, Deque[_Action]] = {op: deque() for op in SEAM_OPS}
        self._stalled: Dict[str, asyncio.Event] = {}
        self.calls: Dict[str, int] = {op: 0 for op in SEAM_OPS}
        self.faults = 0

    # -- scripting -------------------------------------------------------------------------------

    def fail_next(self, op: str, error: BaseException, *, after: bool = False) -> None:
        """The next ``op`` call raises ``error`` (before or after the inner tier did the work)."""
        self._script(op, ("raise", error, after))

    def hold_next(self, op: str, *, after: bool = False) -> Gate:
        """The next ``op`` call waits at the returned gate until ``gate.release()``."""
        gate = Gate()
        self._script(op, ("hold", gate, after))
        return gate

    def delay_next(self, op: str, seconds: float, *, after: bool = False) -> None:
        self._script(op, ("delay", seconds, after))

    def stall(self, op: str) -> None:
        """Every ``op`` call from now on waits (before the inner call) until ``heal()``."""
        self._op(op)
        self._stalled.setdefault(op, asyncio.Event())

    def heal(self) -> None:
        """Drop every scripted action and let stalled calls go on."""
        for script in self._scripts.values():
            for kind, payload, _ in script:
                if kind == "hold":
                    payload.release()
            script.clear()
        stalled, self._stalled = self._stalled, {}
        for event in stalled.values():
            event.set()

    def pending(self, op: str) -> int:
        """Scripted actions not consumed yet for ``op``."""
        return len(self._scripts[self._op(op)])

    def _op(self, op: str) -> str:
        if op not in SEAM_OPS:
            raise ValueError(f"op must be one of {SEAM_OPS}, got {op!r}")
        return op

    def _script(self, op: str, action: _Action) -> None:
        self._scripts[self._op(op)].append(action)

    async def _run(self, op: str, coro_factory):
        self.calls[op] += 1
        action = self._scripts[op].popleft() if self._scripts[op] else None
        stall = self._stalled.get(op)
        if stall is not None:
            await stall.wait()
        if action is not None and not action[2]:
            await self._act(action)
        result = await coro_factory()
        if action is not None and action[2]:
            await self._act(action)
        return result

    async def _act(self, action: _Action) -> None:
        kind, payload, _ = action
        if kind == "raise":
            self.faults += 1
            raise payload
        if kind == "hold":
            await payload._pass()
        elif kind == "delay":
            await asyncio.sleep(payload)

    # -- the tier --------------------------------------------------------------------------------

    async def put_many(self, items: Sequence[PutItem]):
        """Delegates after the scripted action; returns what the inner tier returns."""
        return await self._run("put_many", lambda: self.inner.put_many(items))

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        return await self._run("get_many_into", lambda: self.inner.get_many_into(items))

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        return await self._run("delete_many", lambda: self.inner.delete_many(keys))

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        return await self._run("contains_many", lambda: self.inner.contains_many(keys))

    async def list_keys(self) -> List[bytes]:
        return await self._run("list_keys", self.inner.list_keys)

    async def snapshot_keys(self) -> KeySnapshot:
        """The inner tier's sequence read first, then the keys through the seam (so a hold on
        ``list_keys`` holds a snapshot too); like the contract's default, the keys may reflect
        later mutations."""
        sequence = self.inner.sequence
        return KeySnapshot(frozenset(await self.list_keys()), sequence)

    async def close(self) -> None:
        self.heal()
        await self.inner.close()

    def __getattr__(self, name: str):
        # Tier-specific extras (path_for, verify, gc, ...) pass through to the inner tier.
        return getattr(self.inner, name)
