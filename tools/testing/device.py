"""A CPU device backend that runs the CUDA code path and logs every ordering call.

``RecordingBackend`` is a ``DeviceBackend("cpu")`` whose views take the path a CUDA view takes
(``host_fast_path`` is false: staging buffers, one copy per chunk, copy streams, events), with
streams and events as named tokens. Every ``record``, ``wait``, ``sync``, ``keep`` (a KV tensor
``record_stream``-ed for a copy stream) and ``copy`` is appended to
``log`` as ``(op, stream, event number, thread name)`` in call order, so a test sees when and on
which stream an order was taken. ``fail_on_copy=k`` makes the k-th copy raise ``InjectedFault``
(a copy failing after others were queued); ``on_sync`` is called at every ``sync`` (a test looks at
the engine's books while the failed batch waits for its queued copies).

Thread-safe: the engine calls it from its loop thread and its copy threads.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Tuple

import torch

from kvtier.errors import InjectedFault
from kvtier.tiers.device_backend import DeviceBackend

__all__ = ["RecordingBackend", "TokenEvent"]


@dataclass(frozen=True)
class TokenEvent:
    """A recorded point on a named stream (the CPU stand-in of a ``torch.cuda.Event``)."""

    number: int
    stream: str


class RecordingBackend(DeviceBackend):
    """See the module docstring."""

    def __init__(self, fail_on_copy: Optional[int] = None, on_sync: Optional[Callable[[], Any]] = None) -> None:
        super().__init__("cpu")
        self.fail_on_copy = fail_on_copy
        self.on_sync = on_sync
        self.log: List[Tuple[str, str, Optional[int], str]] = []
        self.copies = 0
        self._streams = 0
        self._events = 0
        self._log_lock = threading.Lock()
        self._local = threading.local()

    def _note(self, op: str, stream: str, number: Optional[int]) -> None:
        self.log.append((op, stream, number, threading.current_thread().name))

    @property
    def host_fast_path(self) -> bool:
        return False

    @property
    def copy_workers(self) -> int:
        return 2  # the CUDA path's: batch n+1 queues while batch n waits in ``synchronize``

    def new_stream(self, priority: int = 0) -> Any:
        with self._log_lock:
            self._streams += 1
            return f"copy{self._streams}"

    def current_stream(self) -> Any:
        return getattr(self._local, "stream", "default")

    def stream_scope(self, stream: Any) -> ContextManager[Any]:
        return self._scope(stream)

    @contextlib.contextmanager
    def _scope(self, stream: Any) -> Iterator[None]:
        before = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def record_event(self, stream: Any) -> Any:
        with self._log_lock:
            self._events += 1
            event = TokenEvent(self._events, str(stream))
            self._note("record", str(stream), event.number)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        with self._log_lock:
            self._note("wait", str(stream), getattr(event, "number", None))

    def event_done(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        with self._log_lock:
            self._note("sync", getattr(event, "stream", "?"), getattr(event, "number", None))
        if self.on_sync is not None:
            self.on_sync()

    def keep_alive_on(self, tensor: torch.Tensor, stream: Any) -> None:
        with self._log_lock:
            self._note("keep", str(stream), None)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._log_lock:
            self.copies += 1
            failing = self.fail_on_copy is not None and self.copies == self.fail_on_copy
            self._note("copy_failed" if failing else "copy", str(self.current_stream()), None)
        if failing:
            raise InjectedFault(f"injected failure of copy {self.copies}")
        super().copy(dst, src)

    def ops(self, *names: str) -> List[Tuple[str, str, Optional[int]]]:
        """The log without thread names, only ``names`` when given."""
        return [(op, stream, n) for op, stream, n, _ in self.log if not names or op in names]
