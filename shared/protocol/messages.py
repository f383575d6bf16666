"""Every message that crosses NATS (each registered with the codec under its tag), and the location names they carry.

Only headers travel as messages: bulk chunk bytes take the shared-memory or stream paths (docs/architecture.md)
except where a message says `data`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.protocol.codec import message
from kvmesh.shared.wire.keys import KeyExtras, KeyParams

# Location names of LMCache's controller REST API (docs/compatibility.md).
LOCAL_CPU = "LocalCPUBackend"
LOCAL_DISK = "LocalDiskBackend"
REMOTE = "RemoteBackend"
LOCATIONS = (LOCAL_CPU, LOCAL_DISK, REMOTE)
# Another instance's CPU tier, read over P2P (enable_p2p): a place lookups and loads walk, never a command's target.
PEER = "P2PBackend"


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
    # admitted chunks' parent, token ids and extras digests where the producer knows them (an engine's saves),
    # for the controller's KV event stream: shared/wire/kv_events.py `description_item` / `parse_description`
    described: list[list[Any]] = field(default_factory=list)


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
    reply is a `CommandReply` whose `num_tokens` is the held prefix in tokens. Chunks that end at or before
    `prefetch_from` (the tokens vLLM's own prefix cache holds) are looked up but not prefetched: no load reads them.
    """

    keys: list[bytes]
    num_tokens: int
    # prefill/decode: the producer's worker of this rank a request's hint names (adapter/pd.py; client input, so
    # only waited for, never read from unless the controller names it); "" for none
    peer_instance: str = ""
    peer_worker: str = ""
    prefetch_from: int = 0
    # the request's kv_load_tiers: the only locations looked in (None: all)
    tiers: list[str] | None = None
    # the keys name recurrent states, not chunks (a model with state groups: its chunks and states differ in bytes)
    state: bool = False


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
    # the storing request's kv_priority and lease (seconds left): the disk and remote stores keep the chunk over
    # the rest within the putting principal's share (--retained-share)
    priority: int = 0
    lease_secs: float = 0.0


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
# and, for puts and found gets, the chunk's raw bytes; see shared/wire/stream_wire.py.


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
    tls: bool = False  # the port speaks TLS only: a client verifies it against its CA, or does not connect


@message("stream_hello")
@dataclass(frozen=True)
class StreamHello:
    """The first request on a new stream connection; answered with Ack."""

    ticket: bytes
    client: str = ""
