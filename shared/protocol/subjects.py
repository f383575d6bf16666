"""Every NATS subject name (`Subjects`), and the op vocabulary of the worker commands sent on them.

A subject a producer publishes on ends in its producer path (principals.py), so NATS permissions say who sent it;
`Subjects.producer_of` reads that sender back as a `ProducerPath`.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

_TOKEN_SAFE = frozenset(string.ascii_letters + string.digits + "-")  # kept as they are in a subject token
_TOKEN_PATTERN = re.compile(r"(?:[A-Za-z0-9-]|_[0-9a-f]{2})+")  # what `Subjects.token` makes

CONFLICT_OP = "conflict"  # `Subjects.worker(..., CONFLICT_OP)`: InstanceConflict notices to a worker
# The op vocabulary of `WorkerCommand` (`Subjects.worker(..., op)`), by who answers or sends it:
TIER_OPS = ("pin", "unpin", "clear", "lookup")  # what one tier of a worker answers (StorageManager.command)
# what an engine worker answers: `move` from one of its tiers to another, or from a peer's CPU tier (P2P) to one of
# its own; `evict` drops chunks from its CPU tier (the source's part of a move between instances); `prefetch` starts
# moving the held prefix from its lower tiers into its CPU tier (the controller's /prefetch)
WORKER_COMMAND_OPS = (*TIER_OPS, "move", "evict", "prefetch")
# what the controller sends (its lookups use its index)
CONTROLLER_COMMAND_OPS = ("pin", "unpin", "clear", "move", "evict", "prefetch")
PREFIX_LOOKUP_OP = "prefix_lookup"  # the scheduler's lower-tier lookup, on a worker's lookup subject


@dataclass(frozen=True)
class ProducerPath:
    """What a subject ending in a producer path says about its sender (see `Subjects.producer_of`)."""

    role: str  # "engine" or "store"
    owner: str  # the instance or store token
    producer: str  # the producer's token

    @property
    def path(self) -> str:
        return f"{self.role}.{self.owner}.{self.producer}"

    def owns(self, owner_id: str, producer_id: str) -> bool:
        """Whether a message body naming `owner_id` / `producer_id` is this sender's own."""
        return Subjects.token(owner_id) == self.owner and Subjects.token(producer_id) == self.producer


class Subjects:
    """All NATS subject names, in one place. `<id>` parts are sanitised by `token()`.

    Every subject a producer or a store caller publishes ends in its producer path (`Principal.producer`), and
    every command subject names its receiver, so NATS permissions can bind each to one principal
    (docs/security.md).
    """

    PREFIX = "kvmesh"
    CONTROLLER_HELLO = f"{PREFIX}.ctrl.hello"  # ControllerHello: a (re)started controller asks all to resync
    PING_ALL = f"{PREFIX}.ping"  # HealthRequest that every service answers (collect replies for a moment)
    REGISTER_ALL = f"{PREFIX}.ctrl.register.>"
    HEARTBEAT_ALL = f"{PREFIX}.ctrl.heartbeat.>"
    EVENTS_ALL = f"{PREFIX}.events.>"
    PEER_LOOKUP_ALL = f"{PREFIX}.ctrl.peer_lookup.>"

    @staticmethod
    def token(name: str) -> str:
        """A NATS subject token from an id: ASCII letters, digits and '-' as they are, every other character
        (dots, spaces, wildcards, the escape '_' itself) as `_xx` per UTF-8 byte. Injective, so ids such as
        `a.b` and `a_b` never share a token, nor the NATS user and subjects that derive from it."""
        if not name:
            raise ValueError("empty subject token")
        return "".join(c if c in _TOKEN_SAFE else "".join(f"_{b:02x}" for b in c.encode()) for c in name)

    @staticmethod
    def is_token(text: str) -> bool:
        """Whether `text` is a token `token()` can make (so it matches the subjects of that one id alone)."""
        return _TOKEN_PATTERN.fullmatch(text) is not None

    @classmethod
    def register(cls, producer_path: str) -> str:
        """RegisterEngine / RegisterStore of one producer."""
        return f"{cls.PREFIX}.ctrl.register.{producer_path}"

    @classmethod
    def heartbeat(cls, producer_path: str) -> str:
        return f"{cls.PREFIX}.ctrl.heartbeat.{producer_path}"

    @classmethod
    def peer_lookup(cls, producer_path: str) -> str:
        """PeerLookup of one engine worker to the controller (P2P hits): which peer's CPU tier holds these chunks."""
        return f"{cls.PREFIX}.ctrl.peer_lookup.{producer_path}"

    @classmethod
    def peer_stream(cls, domain: str, instance_id: str, worker_id: str, caller_path: str) -> str:
        """StreamRequest of the engine worker at `caller_path` to a peer worker of its sharing domain `domain`, for a
        stream of that worker's CPU tier (P2P hits); NATS lets an engine publish these only in its own domain."""
        return f"{cls.PREFIX}.p2p.{cls.token(domain)}.{cls.token(instance_id)}.{cls.token(worker_id)}.{caller_path}"

    @classmethod
    def events(cls, producer_path: str) -> str:
        """AdmissionBatch and SyncChunk messages of one producer."""
        return f"{cls.PREFIX}.events.{producer_path}"

    @classmethod
    def sync(cls, producer_path: str) -> str:
        """SyncRequest to one producer; it answers Ack, then publishes SyncChunks on its events subject."""
        return f"{cls.PREFIX}.sync.{producer_path}"

    @classmethod
    def health(cls, path: str) -> str:
        """HealthRequest to one service: a producer path, or `controller`."""
        return f"{cls.PREFIX}.health.{path}"

    @classmethod
    def worker(cls, instance_id: str, worker_id: str, op: str) -> str:
        """WorkerCommand to one engine worker (op: pin, unpin, clear, lookup, prefix_lookup)."""
        return f"{cls.PREFIX}.worker.{cls.token(instance_id)}.{cls.token(worker_id)}.{op}"

    @classmethod
    def store(cls, store_id: str, op: str, caller_path: str) -> str:
        """A chunk-store operation (op: put, get, cancel_get, contains, touch, remove, clear, pin, unpin, stats,
        stream, wipe) sent by `caller_path` (an engine worker's producer path, `controller` or `operator`)."""
        return f"{cls.PREFIX}.store.{cls.token(store_id)}.{op}.{caller_path}"

    @classmethod
    def store_op(cls, store_id: str, op: str) -> str:
        """What a store subscribes for `op`: the op from every caller."""
        return f"{cls.PREFIX}.store.{cls.token(store_id)}.{op}.>"

    @classmethod
    def store_op_from(cls, store_id: str, op: str, principal_path: str) -> str:
        """What a store subscribes for `op` from one principal alone: any producer of the principal at
        `principal_path` (`engine.<instance>`: `engine.<instance>.<worker>` callers), no other caller."""
        return f"{cls.PREFIX}.store.{cls.token(store_id)}.{op}.{principal_path}.*"

    @classmethod
    def caller_of_store_op(cls, subject: str) -> str:
        """The caller path at the end of a store-op subject (`store()`)."""
        return subject.split(".", 4)[4]

    @classmethod
    def producer_of(cls, subject: str, wildcard: str) -> ProducerPath | None:
        """The sender of a message on one of the `*_ALL` subjects (`wildcard`), or None if the subject does not
        end in a producer path."""
        tokens = subject[len(wildcard) - 1:].split(".") if subject.startswith(wildcard[:-1]) else []
        if len(tokens) != 3 or tokens[0] not in ("engine", "store") or not all(tokens):
            return None
        return ProducerPath(*tokens)
