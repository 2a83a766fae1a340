"""A circuit breaker per remote node: after repeated failures the node is skipped for a while, so a
dead or stalled server costs one timeout, not one per request. Pure bookkeeping on the event-loop
thread; the clock is injectable for tests.

States: ``closed`` (calls go through), ``open`` (calls are refused at once until ``reset_s`` has
passed since it opened), ``half-open`` (one probe call is let through; its success closes the
breaker, its failure opens it again for another ``reset_s``).
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["CircuitBreaker", "CLOSED", "OPEN", "HALF_OPEN"]

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"


class CircuitBreaker:
    """``allow()`` before a call (False: refuse it), then ``success()`` or ``failure()``. Event-loop
    thread only (no lock)."""

    def __init__(self, failure_threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not reset_s > 0:
            raise ValueError(f"reset_s must be > 0, got {reset_s}")
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self._clock = clock
        self._failures = 0
        self._opened_at = 0.0
        self._state = CLOSED
        self._probing = False
        self.opens = 0  # how many times it opened (a metric)

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self.reset_s:
            return HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """True if a call may go: always when closed; once (the probe) when half-open."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def needs_probe(self) -> bool:
        """True when the breaker waits for a probe: the caller should send a cheap one (PING)."""
        return self.state == HALF_OPEN and not self._probing

    def success(self) -> None:
        self._failures = 0
        self._probing = False
        self._state = CLOSED

    def failure(self) -> None:
        self._failures += 1
        if self._probing or self._failures >= self.failure_threshold:
            if self._state != OPEN or self._probing:
                self.opens += 1
            self._state = OPEN
            self._opened_at = self._clock()
        self._probing = False

    def trip(self) -> None:
        """Open at once (a timeout: the next call would cost another one)."""
        self._failures = self.failure_threshold - 1
        self.failure()
