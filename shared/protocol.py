"""Every message that crosses NATS, and every subject name: the one schema module of KVMesh.

A message is a frozen dataclass registered with `@message("tag")`. On the wire it is a msgpack map
`{"v": PROTOCOL_VERSION, "t": tag, <fields>}`; only headers travel this way, bulk chunk bytes take the
shared-memory or stream paths (docs/architecture.md) except where a message says `data`.

`decode(payload, Expected)` returns an `Expected` or raises `ProtocolError` (garbage, wrong version, wrong
tag, missing or mistyped field). Services log that and drop the message; they never crash on it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import socket
import string
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import msgpack

from kvmesh.shared.errors import ProtocolError
from kvmesh.shared.keys import KeyExtras, KeyParams

PROTOCOL_VERSION = 1

# Location names of LMCache's controller REST API (docs/compatibility.md).
LOCAL_CPU = "LocalCPUBackend"
LOCAL_DISK = "LocalDiskBackend"
REMOTE = "RemoteBackend"
LOCATIONS = (LOCAL_CPU, LOCAL_DISK, REMOTE)
# Another instance's CPU tier, read over P2P (enable_p2p): a place lookups and loads walk, never a command's target.
PEER = "P2PBackend"


_TOKEN_SAFE = frozenset(string.ascii_letters + string.digits + "-")  # kept as they are in a subject token
_TOKEN_PATTERN = re.compile(r"(?:[A-Za-z0-9-]|_[0-9a-f]{2})+")  # what `Subjects.token` makes

ROLES = ("engine", "store", "controller", "operator")


@dataclass(frozen=True)
class Principal:
    """Who a NATS client is. Its `path` ends every subject it may publish on, and the mesh's NATS permissions
    (shared/nats_permissions.py) let only that principal's credentials publish there: so a subject, not the
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
CONFLICT_OP = "conflict"  # `Subjects.worker(..., CONFLICT_OP)`: InstanceConflict notices to a worker
# The op vocabulary of `WorkerCommand` (`Subjects.worker(..., op)`), by who answers or sends it:
TIER_OPS = ("pin", "unpin", "clear", "lookup")  # what one tier of a worker answers (StorageManager.command)
# what an engine worker answers: `move` from one of its tiers to another, or from a peer's CPU tier (P2P) to one of
# its own; `evict` drops chunks from its CPU tier (the source's part of a move between instances)
WORKER_COMMAND_OPS = (*TIER_OPS, "move", "evict")
CONTROLLER_COMMAND_OPS = ("pin", "unpin", "clear", "move", "evict")  # what the controller sends (its lookups use its index)
PREFIX_LOOKUP_OP = "prefix_lookup"  # the scheduler's lower-tier lookup, on a worker's lookup subject


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


def disk_store_id(host: str | None = None) -> str:
    """The disk store's id: one per host."""
    return f"disk-{host or socket.gethostname()}"


def remote_store_id(partition: int) -> str:
    """The id of the remote store serving key partition `partition`."""
    return f"remote-{partition}"


def redis_store_id(key_prefix: str) -> str:
    """The id of a Redis / Valkey remote tier: one per key namespace (`redis_key_prefix`), whatever the server."""
    return f"redis-{Subjects.token(key_prefix)}"


M = TypeVar("M")
_REGISTRY: dict[str, type] = {}
_TAGS: dict[type, str] = {}


def message(tag: str):
    """Class decorator: register a dataclass as a wire message under `tag`."""

    def register(cls: type[M]) -> type[M]:
        if tag in _REGISTRY:
            raise RuntimeError(f"duplicate message tag {tag!r}")
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return register


def encode(msg: Any) -> bytes:
    """A registered message as msgpack bytes."""
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered protocol message")
    body = _fields_of(msg)
    body["v"] = PROTOCOL_VERSION
    body["t"] = tag
    return msgpack.packb(body, use_bin_type=True)


def decode(payload: bytes, expected: type[M]) -> M:
    """Decode `payload` as an `expected` message, or raise ProtocolError saying what is wrong."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"{expected.__name__}: undecodable payload ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{expected.__name__}: payload is a {type(body).__name__}, not a map")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"{expected.__name__}: protocol version {body.get('v')!r}, expected {PROTOCOL_VERSION}")
    tag = _TAGS[expected]
    if body.get("t") != tag:
        raise ProtocolError(f"{expected.__name__}: message type {body.get('t')!r}, expected {tag!r}")
    return _from_fields(expected, body)


def _fields_of(msg: Any) -> dict[str, Any]:
    """A dataclass as a plain dict; nested dataclasses (e.g. ChunkMeta) become dicts too."""
    body: dict[str, Any] = {}
    for spec in _plan(type(msg)):
        value = getattr(msg, spec.name)
        body[spec.name] = _fields_of(value) if spec.nested is not None and value is not None else value
    return body


def _from_fields(cls: type[M], body: dict[str, Any]) -> M:
    kwargs: dict[str, Any] = {}
    for spec in _plan(cls):
        if spec.name in body:
            value = body[spec.name]
            if spec.nested is not None and isinstance(value, dict):
                value = _from_fields(spec.nested, value)
            elif not spec.conforms(value):
                raise ProtocolError(f"{cls.__name__}.{spec.name}: bad value of type {type(value).__name__}")
            kwargs[spec.name] = value
        elif spec.required:
            raise ProtocolError(f"{cls.__name__}: missing field {spec.name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a message's own checks (__post_init__)
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


@dataclass(frozen=True)
class _FieldPlan:
    """How one field of a message class is encoded and checked, worked out once per class (the hot path of
    every message, e.g. a stream get's reply, only runs these)."""

    name: str
    required: bool
    nested: type | None  # the dataclass inside the annotation (`X` or `X | None`), if any
    conforms: Callable[[Any], bool]  # the annotation's type check for a decoded msgpack value


_PLANS: dict[type, tuple[_FieldPlan, ...]] = {}


def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        plan = tuple(_FieldPlan(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                                _nested_dataclass(hints[f.name]), _checker(hints[f.name]))
                     for f in dataclasses.fields(cls))
        _PLANS[cls] = plan
    return plan


def _nested_dataclass(hint: Any) -> type | None:
    """The dataclass type inside `hint` (`X` or `X | None`), if any."""
    candidates = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for candidate in candidates:
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A shallow-but-useful type check of a decoded msgpack value against a field annotation."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda value: True
    if origin in (typing.Union, types.UnionType):
        options = tuple(_checker(arg) for arg in typing.get_args(hint))
        return lambda value: any(check(value) for check in options)
    if hint is type(None):
        return lambda value: value is None
    if hint is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _checker(item_hint)
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        key, val = _checker(key_hint), _checker(value_hint)
        return lambda value: isinstance(value, dict) and all(key(k) and val(v) for k, v in value.items())
    if isinstance(hint, type):
        return lambda value: isinstance(value, hint)
    return lambda value: True


# ---------------------------------------------------------------------------------------------------------
# Generic replies and health


@message("ack")
@dataclass(frozen=True)
class Ack:
    """Reply to a request that only succeeds or fails."""

    ok: bool = True
    error: str | None = None


@message("health_request")
@dataclass(frozen=True)
class HealthRequest:
    pass


@message("health_reply")
@dataclass(frozen=True)
class HealthReply:
    service: str  # "controller", "disk_store", "remote_store", "engine"
    service_id: str
    status: str = "ok"
    details: dict[str, Any] = field(default_factory=dict)
    # The replier's path (a producer path, or `controller`): only that principal may subscribe to
    # `Subjects.health(path)`, so a ping-all reply is believed once a request there is answered (service.ping_all).
    path: str = ""


# ---------------------------------------------------------------------------------------------------------
# Registration, liveness and the admission index (producers -> controller)


@message("register_engine")
@dataclass(frozen=True)
class RegisterEngine:
    """An engine worker (one per vLLM rank) announces itself and how it names chunks."""

    worker_id: str  # unique per rank: "<instance_id>" for rank 0 of a single-GPU instance, else "<instance_id>.r<rank>"
    instance_id: str
    model: str
    kv_format: str
    world_size: int
    rank: int
    chunk_size: int
    save_unfull_chunk: bool
    disk_store: str | None = None  # store_id of the host's disk store, if local_disk is configured
    remote_stores: list[str] = field(default_factory=list)  # store_ids of the remote partitions, in partition order
    started_at: float = 0.0
    kv_replicated: bool = False  # every rank holds the same KV (MLA): keys are those of rank 0 of 1
    lora_adapters: dict[str, str] = field(default_factory=dict)  # LoRA name -> identity (KeyExtras.lora_id)
    host: str = ""  # the worker's host name ("": not reported, an older engine)
    ip: str = ""  # the address it reaches the mesh from (LMCache's worker `ip`; /query_instance looks it up)
    domain: str = "default"  # its sharing domain, mixed into its keys ("default": an older engine, or none set)
    p2p: bool = False  # it serves its CPU tier to peers of its domain (enable_p2p)
    peer_endpoint: str = ""  # "host:port" of that stream ("" without P2P); /query_worker_info's peer_init_url

    def key_params(self) -> KeyParams:
        """How this worker names its chunks."""
        if self.kv_replicated:
            return KeyParams(self.model, self.kv_format, 1, 0, self.domain)
        return KeyParams(self.model, self.kv_format, self.world_size, self.rank, self.domain)


@message("instance_conflict")
@dataclass(frozen=True)
class InstanceConflict:
    """Controller -> engine worker (`Subjects.worker(instance_id, worker_id, "conflict")`): other live workers
    claim the same instance id and rank, so the controller serves the instance id from one of them only."""

    instance_id: str
    rank: int
    serving: str  # the worker_id the instance id's lookups and commands go to
    others: list[str] = field(default_factory=list)  # "<worker_id> on <host> (<ip>)" of every live claimant


@message("register_store")
@dataclass(frozen=True)
class RegisterStore:
    store_id: str
    location: str  # LOCAL_DISK or REMOTE
    partition: int = 0
    num_partitions: int = 1
    capacity_bytes: int = 0
    started_at: float = 0.0


@message("heartbeat")
@dataclass(frozen=True)
class Heartbeat:
    producer_id: str  # worker_id or store_id
    last_seq: int  # sequence number of the last AdmissionBatch published (0 before any)
    time: float = 0.0


@message("controller_hello")
@dataclass(frozen=True)
class ControllerHello:
    """Broadcast by a starting controller: every producer registers again and sends a full sync."""

    controller_id: str
    started_at: float


@message("admission_batch")
@dataclass(frozen=True)
class AdmissionBatch:
    """Keys that entered or left one location of one producer since the previous batch.

    `seq` increases by one per batch per producer; a gap tells the controller to ask for a full sync.
    """

    producer_id: str
    location: str
    seq: int
    admitted: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)


@message("sync_request")
@dataclass(frozen=True)
class SyncRequest:
    reason: str = ""


@message("sync_chunk")
@dataclass(frozen=True)
class SyncChunk:
    """One part of a full sync: together, the parts of `sync_id` are every key the producer holds.

    `seq` is the producer's batch sequence at the time of the sync; batches after it apply on top.
    """

    producer_id: str
    location: str
    sync_id: str
    seq: int
    part: int
    final: bool
    keys: list[bytes] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# Commands (controller -> engine worker, engine worker / controller -> store)


@message("worker_command")
@dataclass(frozen=True)
class WorkerCommand:
    """pin / unpin / clear / lookup / move at one location of one engine worker."""

    op: str
    location: str
    tokens: list[int] = field(default_factory=list)
    ttl_secs: float | None = None  # pins: None = until unpinned
    extras: KeyExtras | None = None  # what besides the tokens the chunks were keyed with (LoRA, cache_salt...)
    target: str = ""  # move: the location the chunks go to
    keep_source: bool = True  # move: a copy (True), or the chunks leave `location` (only the worker's own tier)
    # move between instances: the worker of the source instance whose CPU tier the chunks are read from (P2P);
    # `location` is then that worker's (LocalCPUBackend) and `target` this worker's
    peer_instance: str = ""
    peer_worker: str = ""


@message("prefix_lookup")
@dataclass(frozen=True)
class PrefixLookup:
    """Scheduler -> worker: how many leading chunks of a request are held over all tiers (start prefetching them).

    `keys` are the request's chain keys (the worker derives its shard's keys), `num_tokens` its length; the
    reply is a `CommandReply` whose `num_tokens` is the held prefix in tokens.
    """

    keys: list[bytes]
    num_tokens: int
    # prefill/decode: the producer's worker of this rank a request's hint names (adapter/pd.py; client input, so
    # only waited for, never read from unless the controller names it); "" for none
    peer_instance: str = ""
    peer_worker: str = ""


@message("peer_lookup")
@dataclass(frozen=True)
class PeerLookup:
    """Engine worker -> controller (`Subjects.peer_lookup`): which live workers of other instances, in the asker's
    sharing domain, serve the leading `keys` (the asker's shard keys, in prefix order) from their CPU tiers: each
    key's holder of record, the first of them to admit it (services/controller/peers.py). The reply is a
    PeerLookupReply. Its size is bounded by the NATS server's max_payload."""

    worker_id: str  # the asker (the subject's producer path must be its own)
    keys: list[bytes]
    exclude: list[str] = field(default_factory=list)  # workers whose chunks of this chain failed the asker's check
    producer: str = ""  # a PD hint's producer worker for these keys (adapter/pd.py): the reply says if it is live


@message("peer_lookup_reply")
@dataclass(frozen=True)
class PeerLookupReply:
    instance_id: str = ""  # the holder of record of the first key ("" when no live peer holds it)
    worker_id: str = ""
    num_chunks: int = 0  # how many leading keys that worker is the holder of record of
    # the holders of record of the keys after those, run by run: (instance, worker, chunks) in parallel lists
    more_instances: list[str] = field(default_factory=list)
    more_workers: list[str] = field(default_factory=list)
    more_chunks: list[int] = field(default_factory=list)
    producer_live: bool = False  # the lookup's `producer` is a live peer of the asker's domain it may read from

    def runs(self) -> list[tuple[str, str, int]]:
        """(instance_id, worker_id, num_chunks) of every run, in key order."""
        first = [(self.instance_id, self.worker_id, self.num_chunks)] if self.num_chunks > 0 else []
        return first + list(zip(self.more_instances, self.more_workers, self.more_chunks))


@message("command_reply")
@dataclass(frozen=True)
class CommandReply:
    ok: bool
    num_tokens: int = 0
    error: str | None = None
    num_chunks: int = 0  # stores: chunks affected (remove, clear, pin, unpin)


@message("chunk_keys")
@dataclass(frozen=True)
class ChunkKeys:
    """Store request naming chunks in prefix order (contains, touch, remove, pin, unpin).

    `num_tokens[i]` is the token count of `keys[i]` (a partial last chunk has fewer than chunk_size).
    """

    keys: list[bytes]
    num_tokens: list[int] = field(default_factory=list)
    ttl_secs: float | None = None


@message("contains_reply")
@dataclass(frozen=True)
class ContainsReply:
    prefix: int  # how many leading keys of the request are held (complete and readable)


@message("clear_request")
@dataclass(frozen=True)
class ClearRequest:
    """A store's `clear`: take back the caller's claims (the caller is the subject's last tokens)."""


@message("wipe_request")
@dataclass(frozen=True)
class WipeRequest:
    """A store's `wipe`: forget every unpinned chunk, whoever put it; the operator's alone."""


@message("stats_request")
@dataclass(frozen=True)
class StatsRequest:
    pass


@message("stats_reply")
@dataclass(frozen=True)
class StatsReply:
    store_id: str
    num_chunks: int
    used_bytes: int
    capacity_bytes: int
    pinned_chunks: int = 0
    details: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# Chunk data (engine <-> stores). Bytes travel by shared memory (same host) or by a stream/frames; the
# messages carry where the bytes are, never a 32 MiB payload through msgpack.


@message("chunk_meta")
@dataclass(frozen=True)
class ChunkMeta:
    """What a chunk's bytes are: enough to rebuild the tensor."""

    key: bytes
    num_tokens: int
    shape: list[int]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    fmt: str  # KV layout tag, e.g. "LBHNC-128" or "L2TD"
    nbytes: int
    checksum: int = 0  # xxh3 of the bytes (chunk_file.checksum); a put without one (0) is refused


# Room for the msgpack envelope around inline chunk bytes: inline data fits a message up to max_payload minus this.
INLINE_HEADROOM = 64 * 1024


@message("put_request")
@dataclass(frozen=True)
class PutRequest:
    meta: ChunkMeta
    pool: str | None = None  # token of the pool the caller lent the disk store (holds the bytes at pool_offset)
    pool_offset: int = 0
    data: bytes | None = None  # inline bytes (small chunks, or one frame of a framed transfer)
    producer: str = ""


MAX_GET_ID = 2**63 - 1  # get ids are the client's counter: positive, and never near wrapping


@message("get_request")
@dataclass(frozen=True)
class GetRequest:
    """A chunk into the caller's lent pool (or inline). A pooled get names a `get_id` (> 0, unique per client)
    and the engine's `time.monotonic()` `deadline` (pools are lent on one host, which shares CLOCK_MONOTONIC):
    the store refuses it, writing nothing, when it arrives after the deadline or after a `CancelGet` of its id.
    get_id 0 (an engine from before get ids): served as before, without either check."""

    key: bytes
    pool: str | None = None  # token of the caller's lent pool, where the store should write the bytes
    pool_offset: int = 0
    capacity: int = 0  # bytes available at pool_offset
    get_id: int = 0
    deadline: float = 0.0

    def __post_init__(self) -> None:
        _check_get_id(self.get_id, allow_zero=True)
        _check_deadline(self.deadline)


@message("cancel_get")
@dataclass(frozen=True)
class CancelGet:
    """Engine -> disk store: the engine gave up on the pooled get `get_id` (of its pool `pool`, sent with
    `deadline`). Answered Ack(ok=True) only once that get can never write into the pool any more: its write
    finished, or it has not arrived and will be refused when it does. ok=False (the store does not know the
    pool, or holds too many cancels) promises nothing."""

    pool: str
    get_id: int
    deadline: float

    def __post_init__(self) -> None:
        if not self.pool:
            raise ValueError("pool: empty token")
        _check_get_id(self.get_id, allow_zero=False)
        _check_deadline(self.deadline)


def _check_get_id(get_id: int, allow_zero: bool) -> None:
    if not (0 if allow_zero else 1) <= get_id <= MAX_GET_ID:
        raise ValueError(f"get_id {get_id} is out of range")


def _check_deadline(deadline: float) -> None:
    if not (math.isfinite(deadline) and deadline >= 0):
        raise ValueError(f"deadline {deadline!r} is not a finite monotonic time")


@message("get_reply")
@dataclass(frozen=True)
class GetReply:
    found: bool
    meta: ChunkMeta | None = None
    data: bytes | None = None
    error: str | None = None


# ---------------------------------------------------------------------------------------------------------
# Direct streams (remote store): negotiated on NATS, then chunk bytes on a TCP connection kept by the client.
# On the stream every request is one op byte, a u32 length, one of these messages (or PutRequest/GetRequest)
# and, for puts and found gets, the chunk's raw bytes; see shared/stream_wire.py.


@message("stream_request")
@dataclass(frozen=True)
class StreamRequest:
    """Ask a store for a direct stream, on `Subjects.store(store_id, "stream")`; it answers StreamOffer."""

    client: str = ""  # who asks, for the store's logs


@message("stream_offer")
@dataclass(frozen=True)
class StreamOffer:
    """Where the store's stream listens, and a single-use ticket that the new connection presents first.

    Tickets are handed out only over NATS, so the stream is open to exactly the clients NATS authorises.
    """

    host: str
    port: int
    ticket: bytes
    store_id: str = ""
    partition: int = 0
    num_partitions: int = 1


@message("stream_hello")
@dataclass(frozen=True)
class StreamHello:
    """The first request on a new stream connection; answered with Ack."""

    ticket: bytes
    client: str = ""
