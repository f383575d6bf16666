"""NATS URLs as KVMesh takes them: one server, or several comma-separated (the servers of a NATS cluster).

`nats://h1:4222,nats://h2:4222,h3:4222` names three servers of one cluster: a client connects to one of them and,
when it dies, reconnects to another (nats-py also learns the cluster's other servers from the one it reaches).
An entry without a scheme is `nats://`; `tls://`, `ws://` and `wss://` are NATS's other schemes.
"""

from __future__ import annotations

import argparse
import urllib.parse

NATS_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})
DEFAULT_PORT = 4222  # NATS's own default port
DEFAULT_URL = f"nats://127.0.0.1:{DEFAULT_PORT}"  # where a service or command joins NATS when told nowhere else


def _normalize_one(address: str) -> str:
    address = address.strip()
    return address if "://" in address else f"nats://{address}"


def split(url: str) -> list[str]:
    """The servers `url` names, each with a scheme ('localhost:9001' -> 'nats://localhost:9001')."""
    return [_normalize_one(part) for part in url.split(",")]


def normalize(url: str) -> str:
    """`url` with a scheme on every server, comma-separated again."""
    return ",".join(split(url))


def problem(url: str) -> str | None:
    """Why `url` names no NATS server(s) KVMesh can connect to, or None when it does."""
    for part in url.split(","):
        if not part.strip():
            return f"an empty entry in {url!r} (several servers are comma-separated: nats://h1:4222,nats://h2:4222)"
        entry = _normalize_one(part)
        scheme = entry.partition("://")[0].lower()
        if scheme not in NATS_SCHEMES:
            return f"{part.strip()!r}: the scheme must be one of {', '.join(sorted(NATS_SCHEMES))}"
        parsed = urllib.parse.urlsplit(entry)
        try:
            parsed.port  # raises on a port that is not a number in 0..65535
        except ValueError:
            return f"{part.strip()!r}: the port is not a number from 1 to 65535"
        if not parsed.hostname:
            return f"{part.strip()!r}: no host"
    return None


def argument(value: str) -> str:
    """argparse `type=` of a --nats-url flag: the normalised URL, or a clear usage error."""
    reason = problem(value)
    if reason is not None:
        raise argparse.ArgumentTypeError(f"not a NATS URL: {reason}")
    return normalize(value)
