"""Every message that crosses NATS, and every subject name: the one schema package of KVMesh.

A message is a frozen dataclass registered with `@message("tag")`. On the wire it is a msgpack map
`{"v": PROTOCOL_VERSION, "t": tag, <fields>}`; only headers travel this way, bulk chunk bytes take the
shared-memory or stream paths (docs/architecture.md) except where a message says `data`.

`decode(payload, Expected)` returns an `Expected` or raises `ProtocolError` (garbage, wrong version, wrong
tag, missing or mistyped field). Services log that and drop the message; they never crash on it.

The package: principals.py (who is who: principals, worker and store ids), subjects.py (`Subjects`, the command
ops), codec.py (`message`, `encode`, `decode`), messages.py (the messages and the location names), usage.py (what a
producer reports of its holdings in its health answer). Its public
names are these modules' together, read as `protocol.X` (`from kvmesh.shared import protocol`).
"""

from kvmesh.shared.errors import ProtocolError
from kvmesh.shared.protocol.codec import PROTOCOL_VERSION, decode, encode, message
from kvmesh.shared.protocol.messages import (
    INLINE_HEADROOM, LOCAL_CPU, LOCAL_DISK, LOCATIONS, MAX_GET_ID, PEER, REMOTE, Ack, AdmissionBatch, CancelGet,
    ChunkKeys, ChunkMeta, ClearRequest, CommandReply, ContainsReply, ControllerHello, GetReply, GetRequest,
    HealthReply, HealthRequest, Heartbeat, InstanceConflict, PeerLookup, PeerLookupReply, PrefixLookup,
    PutRequest, RegisterEngine, RegisterStore, StatsReply, StatsRequest, StreamHello, StreamOffer,
    StreamRequest, SyncChunk, SyncRequest, WipeRequest, WorkerCommand)
from kvmesh.shared.protocol.principals import (
    CONTROLLER, MAX_INCARNATION, OPERATOR, ROLES, Principal, disk_store_id, is_worker_id_of, principal_of,
    redis_store_id, remote_store_id, store_path, worker_id_for)
from kvmesh.shared.protocol.subjects import (
    CONFLICT_OP, CONTROLLER_COMMAND_OPS, PREFIX_LOOKUP_OP, TIER_OPS, WORKER_COMMAND_OPS, ProducerPath, Subjects)
from kvmesh.shared.protocol.usage import USAGE_DETAIL, TierUsage


__all__ = [
    "ProtocolError", "ROLES", "Principal", "MAX_INCARNATION", "worker_id_for", "is_worker_id_of",
    "principal_of", "store_path", "CONTROLLER", "OPERATOR", "disk_store_id", "remote_store_id",
    "redis_store_id", "CONFLICT_OP", "TIER_OPS", "WORKER_COMMAND_OPS", "CONTROLLER_COMMAND_OPS",
    "PREFIX_LOOKUP_OP", "ProducerPath", "Subjects", "PROTOCOL_VERSION", "message", "encode", "decode",
    "LOCAL_CPU", "LOCAL_DISK", "REMOTE", "LOCATIONS", "PEER", "Ack", "HealthRequest", "HealthReply",
    "RegisterEngine", "InstanceConflict", "RegisterStore", "Heartbeat", "ControllerHello", "AdmissionBatch",
    "SyncRequest", "SyncChunk", "WorkerCommand", "PrefixLookup", "PeerLookup", "PeerLookupReply",
    "CommandReply", "ChunkKeys", "ContainsReply", "ClearRequest", "WipeRequest", "StatsRequest", "StatsReply",
    "ChunkMeta", "INLINE_HEADROOM", "PutRequest", "MAX_GET_ID", "GetRequest", "CancelGet", "GetReply",
    "StreamRequest", "StreamOffer", "StreamHello", "USAGE_DETAIL", "TierUsage"]
