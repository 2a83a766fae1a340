"""The bench's busy machine: CPU-bound workers running beside the measured rounds.

A serving host is rarely idle: a tokenizer, a scheduler and a router take cores while the cache
writes and reads. ``busy(kind)`` runs ``BUSY_WORKERS`` spinning workers while its ``with`` block
runs; the bench measures the same paired rounds inside it and reports them beside the quiet ones.

Two kinds, because they load a machine differently:

- ``"threads"``: Python threads of the bench's own process, spinning in bytecode. They take cores
  AND the GIL, as a serving process's own scheduler and tokenizer threads do: every return from a
  blocking call (a ``pwritev``, an ``fdatasync``, a queue wake-up) of the tier's threads waits for
  the GIL behind them (up to ``sys.getswitchinterval()``, 5 ms). This is what a tier running inside
  vLLM's or SGLang's process meets, and the harder case for kvtier's threads. The default.
- ``"processes"``: child processes spinning (another service on the host): they take cores only.

Primitives: ``BUSY_KINDS``, ``BUSY_WORKERS``, ``busy`` (a context manager; workers stop and are
joined or killed on exit) and ``busy_label``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from typing import Iterator, List, Optional

__all__ = ["BUSY_KINDS", "BUSY_WORKERS", "busy", "busy_label"]

BUSY_KINDS = ("threads", "processes")
BUSY_WORKERS = 2  # as many as the cores of the machines these figures come from


def busy_label(kind: Optional[str]) -> str:
    """What the rows of a busy run add to their size label ("" for the quiet run)."""
    return "" if kind is None else f", busy ({BUSY_WORKERS} CPU-bound {kind})"


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        x = 0
        for i in range(20_000):  # pure bytecode: holds the GIL between checks of ``stop``
            x += i


@contextlib.contextmanager
def busy(kind: Optional[str], workers: int = BUSY_WORKERS) -> Iterator[None]:
    """Run ``workers`` CPU-bound workers of ``kind`` ("threads", "processes"; ``None``: none) for
    the block. Raises ``ValueError`` for another kind."""
    if kind is None:
        yield
        return
    if kind not in BUSY_KINDS:
        raise ValueError(f"busy kind must be one of {BUSY_KINDS}, got {kind!r}")
    if kind == "threads":
        stop = threading.Event()
        threads = [threading.Thread(target=_spin, args=(stop,), name=f"kvtier-bench-busy-{i}", daemon=True)
                   for i in range(workers)]
        for t in threads:
            t.start()
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join()
        return
    children: List["subprocess.Popen[bytes]"] = []
    try:
        for _ in range(workers):
            children.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                             stdin=subprocess.DEVNULL))
        yield
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()
