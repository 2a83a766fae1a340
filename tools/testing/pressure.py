"""Scripted pressure sources for tests and the pytest plugin's ``fake_nvml`` fixture.

``ScriptedSource`` returns a scripted list of used-fractions, one per call (any thread: the pressure
monitor polls it from its own thread); ``FakeNvml`` stands in for the NVML device-memory source;
``FakeNvmlLibrary`` stands in for the ``pynvml`` module itself (GPUs by UUID, scripted bytes used).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Iterable, List, Optional

__all__ = ["ScriptedSource", "FakeNvml", "FakeNvmlLibrary", "FakeNvmlError"]


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


class FakeNvmlError(Exception):
    """The fake library's ``NVMLError``."""


class FakeNvmlLibrary:
    """A stand-in for the ``pynvml`` module (pass it as ``nvml=`` to kvtier's NVML sources): GPUs
    by UUID and index, each with ``total`` bytes and a scripted ``used`` curve (one value per
    memory query, then the last one held; ``set_used`` replaces the rest). ``calls`` logs every
    lookup and query as ``(name, argument)``. Thread-safe."""

    NVMLError = FakeNvmlError

    def __init__(self, total: int, used: Iterable[int], *, uuids: Iterable[str] = ("GPU-fake-0",)) -> None:
        self.total = total
        self.uuids = list(uuids)
        self._used = ScriptedSource(used)
        self.calls: List[tuple] = []

    def set_used(self, used: int) -> None:
        self._used.set(used)

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.calls.append(("init", None))

    def nvmlDeviceGetHandleByUUID(self, uuid) -> str:  # noqa: N802
        self.calls.append(("by_uuid", uuid))
        if uuid not in self.uuids:
            raise FakeNvmlError(f"Not Found: {uuid}")
        return uuid

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # noqa: N802
        self.calls.append(("by_index", index))
        if not 0 <= index < len(self.uuids):
            raise FakeNvmlError("Invalid Argument")
        return self.uuids[index]

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        self.calls.append(("memory", handle))
        used = int(self._used())
        return SimpleNamespace(total=self.total, used=used, free=self.total - used)
