"""Scripted pressure sources for tests and the pytest plugin's ``fake_nvml`` fixture.

``ScriptedSource`` returns a scripted list of used-fractions, one per call (any thread: the pressure
monitor polls it from its own thread); ``FakeNvml`` stands in for the NVML device-memory source.
"""

from __future__ import annotations

import threading
from typing import Iterable, List, Optional

__all__ = ["ScriptedSource", "FakeNvml"]


class ScriptedSource:
    """A source that returns a scripted list of fractions, one per call, then holds the last one.

    ``None`` entries script "unknown". ``extend()`` appends to the script and ``set()`` replaces the
    rest of it with one value, so a test (or the pytest plugin's ``fake_nvml`` fixture) can drive a
    monitor through a pressure curve. Thread-safe: the monitor calls it from its polling thread.
    """

    default_unknown_reason = "scripted source has no reading"

    def __init__(self, values: Iterable[Optional[float]] = ()) -> None:
        self._values: List[Optional[float]] = list(values)
        self._position = 0
        self._last: Optional[float] = None
        self._lock = threading.Lock()
        self.calls = 0
        self.unknown_reason: Optional[str] = None

    def __call__(self) -> Optional[float]:
        with self._lock:
            self.calls += 1
            if self._position < len(self._values):
                self._last = self._values[self._position]
                self._position += 1
            value = self._last
            self.unknown_reason = self.default_unknown_reason if value is None else None
            return value

    def extend(self, values: Iterable[Optional[float]]) -> None:
        """Append values to the script."""
        with self._lock:
            self._values.extend(values)

    def set(self, value: Optional[float]) -> None:
        """From the next call on, return ``value`` (drops what is left of the script)."""
        with self._lock:
            del self._values[self._position :]
            self._values.append(value)

    @property
    def remaining(self) -> int:
        """Scripted values not yet returned."""
        with self._lock:
            return len(self._values) - self._position

    def __repr__(self) -> str:
        return f"{type(self).__name__}(calls={self.calls}, remaining={self.remaining})"


class FakeNvml(ScriptedSource):
    """A scripted stand-in for ``nvml_device_memory_source``: device used-fractions, ``None`` for
    "NVML unavailable"."""

    default_unknown_reason = "NVML unavailable (fake NVML scripted no reading)"
