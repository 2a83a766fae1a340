"""Parsing of remote tier addresses: ``redis://host:port`` (one node) and
``redis+cluster://h1:p1,h2:p2`` (cluster seeds). Pure and synchronous.

No credentials are taken from the URL on purpose: a password in a config file or an environment
variable leaks into logs and process listings; kvtier talks to a Valkey/Redis reachable on a
private network (or loopback) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

__all__ = ["RemoteAddress", "parse_remote_url"]

_SCHEMES = ("redis://", "redis+cluster://")


@dataclass(frozen=True)
class RemoteAddress:
    """Where the remote tier connects: ``cluster`` mode or one node, and the seed endpoints.
    Immutable: any thread."""

    cluster: bool
    seeds: Tuple[Tuple[str, int], ...]

    @property
    def url(self) -> str:
        scheme = "redis+cluster://" if self.cluster else "redis://"
        return scheme + ",".join(f"{h}:{p}" for h, p in self.seeds)


def _endpoint(text: str, url: str) -> Tuple[str, int]:
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"remote_url endpoint must be host:port, got {text!r} in {url!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if "@" in host or "/" in host:
        raise ValueError(f"remote_url must not carry credentials or paths, got {url!r}")
    try:
        port = int(port_text, 10)
    except ValueError:
        raise ValueError(f"remote_url port must be a number, got {port_text!r} in {url!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"remote_url port must be in 1..65535, got {port} in {url!r}")
    return host, port


def parse_remote_url(url: str) -> RemoteAddress:
    """``redis://host:port`` -> one node; ``redis+cluster://h1:p1,h2:p2,...`` -> cluster seeds
    (any reachable one is enough to learn the slot map). ``ValueError`` names the bad part."""
    if not isinstance(url, str):
        raise TypeError(f"remote_url must be a str, not {type(url).__name__}")
    scheme = next((s for s in _SCHEMES if url.startswith(s)), None)
    if scheme is None:
        raise ValueError(
            f"remote_url must start with 'redis://' (one node) or 'redis+cluster://' (a cluster), got {url!r}"
        )
    rest = url[len(scheme):].rstrip("/")
    parts = [p for p in rest.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"remote_url names no host:port, got {url!r}")
    cluster = scheme == "redis+cluster://"
    if not cluster and len(parts) != 1:
        raise ValueError(f"'redis://' takes one host:port (use 'redis+cluster://' for several), got {url!r}")
    return RemoteAddress(cluster, tuple(_endpoint(p, url) for p in parts))
