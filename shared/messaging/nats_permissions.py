"""What each principal of the mesh may publish and subscribe on NATS: the server's authorization, per role.

Every subject a principal publishes ends in its own path (shared/protocol/principals.py `Principal`), so these allow lists
bind each message to its sender: an engine instance may register, heartbeat and report events only as itself,
take only its own workers' commands, call stores only under its own path; a store hears only its own ops; only
the controller says hello or asks for a sync; only the operator wipes a store. Replies go to per-principal
inboxes (`_INBOX.<path>.>`, nats-py's `inbox_prefix`), so no principal can read another's replies; responders
answer through `allow_responses` (one reply per request received), not through a publish right on inboxes.

`authorization_block(users)` renders the NATS server config for a list of (path, password, domain), with one
more user that may do nothing at all: the reload probe, whose password is a digest of the block, so a server that
accepts it runs this very block (`reload_probe`; MeshCredentials.reload_server waits for that). docs/security.md
shows the same lists in prose.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from kvmesh.shared.protocol import ROLES, Subjects

P = Subjects.PREFIX
# Store ops an engine worker sends (never `wipe`: an operator's).
ENGINE_STORE_OPS = ("put", "get", "cancel_get", "contains", "touch", "pin", "unpin", "remove", "clear", "stats",
                    "stream")
OPERATOR_STORE_OPS = ("wipe", "stats")


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(path: str) -> str:
    """Where a principal's request replies arrive (nats-py `inbox_prefix`)."""
    return f"_INBOX.{path}"


def permissions(path: str, domain: str = "default") -> Permissions:
    """The allow lists of the principal at `path` (`engine.<instance>`, `store.<id>`, `controller`, `operator`); an
    engine's depend on its sharing domain too: it asks peers of `domain` only for streams (P2P), and only they ask
    it."""
    role, _, name = path.partition(".")
    if role not in ROLES or bool(name) != (role in ("engine", "store")) or "." in name:
        raise ValueError(f"not a principal path: {path!r}")
    inbox = f"{inbox_prefix(path)}.>"
    listen_all = (Subjects.CONTROLLER_HELLO, Subjects.PING_ALL)
    produces = (f"{P}.ctrl.register.{path}.*", f"{P}.ctrl.heartbeat.{path}.*", f"{P}.events.{path}.*")
    asks = (f"{P}.ctrl.peer_lookup.{path}.*",)  # an engine worker's P2P lookup (services/controller/peers.py)
    serves = (f"{P}.sync.{path}.*", f"{P}.health.{path}.*")
    if role == "engine":
        peers = f"{P}.p2p.{Subjects.token(domain)}"
        return Permissions(
            publish=(*produces, *asks, f"{P}.worker.{name}.>", f"{peers}.*.*.{path}.*",
                     *(f"{P}.store.*.{op}.{path}.*" for op in ENGINE_STORE_OPS)),
            subscribe=(f"{P}.worker.{name}.>", f"{peers}.{name}.>", *serves, *listen_all, inbox))
    if role == "store":
        return Permissions(publish=produces, subscribe=(f"{P}.store.{name}.>", *serves, *listen_all, inbox))
    if role == "controller":
        return Permissions(
            publish=(Subjects.CONTROLLER_HELLO, Subjects.PING_ALL, f"{P}.sync.>", f"{P}.worker.>", f"{P}.health.>"),
            subscribe=(Subjects.REGISTER_ALL, Subjects.HEARTBEAT_ALL, Subjects.EVENTS_ALL, Subjects.PEER_LOOKUP_ALL,
                       Subjects.health(path), Subjects.PING_ALL, inbox))
    return Permissions(  # operator: health, stats and wipe; it answers nothing
        publish=(Subjects.PING_ALL, f"{P}.health.>", *(f"{P}.store.*.{op}.{path}" for op in OPERATOR_STORE_OPS)),
        subscribe=(inbox,))


RELOAD_PROBE_USER = "reload-probe"  # no principal path: no role is named so
_PROBE_ENTRY = re.compile(r'\{"user": "' + RELOAD_PROBE_USER + r'", "password": "([0-9a-f]+)"')


def authorization_block(users: list[tuple[str, str, str]]) -> str:
    """The NATS server config's `authorization` block: one user per (principal path, password, sharing domain),
    and the reload probe (denied every subject; its password the digest of the principals' entries)."""
    entries = []
    for path, password, domain in users:
        allowed = permissions(path, domain)
        entries.append(json.dumps({"user": path, "password": password, "permissions": {
            "publish": {"allow": list(allowed.publish)}, "subscribe": {"allow": list(allowed.subscribe)},
            "allow_responses": True}}))
    digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()[:32]
    entries.append(json.dumps({"user": RELOAD_PROBE_USER, "password": digest, "permissions": {
        "publish": {"deny": [">"]}, "subscribe": {"deny": [">"]}}}))
    return "authorization {\n  users: [\n    " + ",\n    ".join(entries) + "\n  ]\n}\n"


def reload_probe(block: str) -> tuple[str, str] | None:
    """The reload probe's (user, password) in an `authorization_block`; None in a block without one (made by a
    KVMesh before the probe existed)."""
    found = _PROBE_ENTRY.search(block)
    return None if found is None else (RELOAD_PROBE_USER, found.group(1))
