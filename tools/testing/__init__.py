"""kvtier.tools.testing: what tests (yours and kvtier's) use to drive kvtier, in one package.

- ``faults``: ``FaultyTier`` (a ``ChunkTier`` wrapper that fails on purpose, raising
  ``kvtier.errors.InjectedFault``), ``IOFaultPlan`` /
  ``inject_io_faults`` / ``remove_io_faults`` (errors under a tier's own I/O calls),
  ``corrupt_stored_record`` (flip a stored byte; forensics kept out of the shipped tiers).
- ``forwarding``: ``ForwardingTier``, a tier that forwards the whole contract to an inner one (the
  base of ``FaultyTier`` and ``SeamTier``; override only what you intercept).
- ``scenario``: ``OffloadScenario`` (a producer and consumers on CPU tensors, exact stored and
  loaded sets), ``make_cpu_device``, ``DEFAULT_TEST_LAYOUT``.
- ``pressure``: ``ScriptedSource`` / ``FakeNvml`` (scripted memory-pressure readings),
  ``FakeNvmlLibrary`` (a stand-in ``pynvml``: GPUs by UUID, scripted bytes used).
- ``device``: ``RecordingBackend`` (a CPU device backend whose views take the CUDA code path and
  log every record / wait / sync / copy; a copy can be made to fail).
- ``tier_seam``: ``SeamTier`` (fail a tier call with any exception, hold it before or after the
  inner tier did the work, stall it) -- the seam of the engine's contract tests.
- ``engine_sim``: ``simulate`` (the seeded, model-based simulation of the engine: random
  interleavings, cancellations and faults, checked against a model after every step; the model,
  device blocks and the tier's history, is ``engine_sim_model``).
- ``valkey``: real Valkey servers on 127.0.0.1 (``start_node``, ``start_cluster``, ``restart_node``,
  ``ValkeyFactory``, ``shared_node()``; the demo and the bench start theirs here too) and remote-tier
  test helpers; the plugin's ``valkey_node`` / ``valkey_cluster`` / ``valkey_factory`` fixtures.
- ``children``: what the fault suite's children and parents share (deterministic chunks whose
  bytes are a function of the key, ``check_cache``, ``run_child``, ``read_line``).
- ``fault_child``: the child process of the kill -9 and multi-process tests
  (``python -m kvtier.tools.testing.fault_child COMMAND ...``) and the parent side that kills it.
- ``corrupt_child``: the corruption trials' child (byte flips, then every read, the verifier and
  ``kvtier verify``).
- ``cache_dir_child`` / ``cache_dir_trial``: journaled children sharing one cache directory (a
  writer, a gc, a read-only reader, a reopen loop) and ``run_trial``, which runs them beside
  ``kvtier verify``/``gc``/``inspect`` and an engine with kill -9 and injected I/O errors and
  checks the directory against their journals.

The pytest plugin (``kvtier.tools.pytest_plugin``) builds its fixtures from these. The scenario
names load on first use: they import torch, which a fault child does not need.
"""

from typing import Any

from .faults import (
    FILE_IO_OPS,
    LMDB_IO_OPS,
    FaultyTier,
    IOFaultPlan,
    corrupt_stored_record,
    inject_io_faults,
    remove_io_faults,
)
from .forwarding import ForwardingTier
from .pressure import FakeNvml, ScriptedSource

__all__ = [
    "ForwardingTier",
    "FaultyTier",
    "IOFaultPlan",
    "inject_io_faults",
    "remove_io_faults",
    "corrupt_stored_record",
    "LMDB_IO_OPS",
    "FILE_IO_OPS",
    "ScriptedSource",
    "FakeNvml",
    "OffloadScenario",
    "make_cpu_device",
    "DEFAULT_TEST_LAYOUT",
]

_SCENARIO = ("OffloadScenario", "make_cpu_device", "DEFAULT_TEST_LAYOUT")


def __getattr__(name: str) -> Any:
    if name in _SCENARIO:
        from . import scenario

        return getattr(scenario, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
