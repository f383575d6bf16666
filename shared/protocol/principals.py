"""Who is who on the mesh: principals (the NATS identities that end every subject they publish on) and the ids of
engine workers and stores."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from kvmesh.shared.protocol.subjects import Subjects

ROLES = ("engine", "store", "controller", "operator")


@dataclass(frozen=True)
class Principal:
    """Who a NATS client is. Its `path` ends every subject it may publish on, and the mesh's NATS permissions
    (shared/messaging/nats_permissions.py) let only that principal's credentials publish there: so a subject, not the
    message body, says who sent it, and a receiver checks the body against it.

    Paths: `engine.<instance_id>`, `store.<store_id>`, `controller`, `operator`. A producer (an engine worker
    of the instance, or the store itself) adds its own token: `engine.<instance>.<worker>`, `store.<id>.<id>`.
    """

    role: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {', '.join(ROLES)}")
        if bool(self.name) != (self.role in ("engine", "store")):
            raise ValueError(f"role {self.role} {'needs' if not self.name else 'takes no'} a name")

    @classmethod
    def engine(cls, instance_id: str) -> "Principal":
        return cls("engine", instance_id)

    @classmethod
    def store(cls, store_id: str) -> "Principal":
        return cls("store", store_id)

    @property
    def path(self) -> str:
        return f"{self.role}.{Subjects.token(self.name)}" if self.name else self.role

    def producer(self, producer_id: str) -> str:
        """The path of one producer (or store caller) of this principal: its path plus the producer's token."""
        return f"{self.path}.{Subjects.token(producer_id)}"


MAX_INCARNATION = 64  # the longest process tag a worker id may end in


def worker_id_for(instance_id: str, world_size: int, rank: int, incarnation: str = "") -> str:
    """An engine worker's producer id: `instance_id` for a single-rank instance, else one id per rank; then
    `@<incarnation>`, a tag of the worker's process, so replicas that keep the same lmcache_instance_id (the
    default one, typically) are still distinct workers on the mesh."""
    base = instance_id if world_size == 1 else f"{instance_id}.r{rank}"
    return f"{base}@{incarnation}" if incarnation else base


def is_worker_id_of(worker_id: str, instance_id: str, world_size: int, rank: int) -> bool:
    """Whether `worker_id` is one `worker_id_for(instance_id, world_size, rank, ...)` makes (any incarnation,
    or none: engines from before incarnations)."""
    base = worker_id_for(instance_id, world_size, rank)
    if worker_id == base:
        return True
    incarnation = worker_id.removeprefix(base + "@")
    return incarnation != worker_id and 0 < len(incarnation) <= MAX_INCARNATION and "@" not in incarnation


def principal_of(caller: str) -> str:
    """The principal path of a caller path: `engine.<instance>` of `engine.<instance>.<worker>`; other callers
    (`operator`, `controller`, `store.<id>...`) are their own."""
    return ".".join(caller.split(".", 2)[:2]) if caller.startswith(("engine.", "store.")) else caller


def store_path(store_id: str) -> str:
    """A store's producer path, `store.<id>.<id>`: a store is its principal's one producer."""
    return Principal.store(store_id).producer(store_id)


CONTROLLER = Principal("controller")
OPERATOR = Principal("operator")


def disk_store_id(host: str | None = None) -> str:
    """The disk store's id: one per host."""
    return f"disk-{host or socket.gethostname()}"


def remote_store_id(partition: int) -> str:
    """The id of the remote store serving key partition `partition`."""
    return f"remote-{partition}"


def redis_store_id(key_prefix: str) -> str:
    """The id of a Redis / Valkey remote tier: one per key namespace (`redis_key_prefix`), whatever the server."""
    return f"redis-{Subjects.token(key_prefix)}"
