"""The controller's request and response bodies (pydantic): what the OpenAPI document declares and FastAPI checks.

Every route but /lookup parses its body with these models; /lookup declares `LookupRequest` in the document and
is parsed by lookup_body.py with the same rules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, WithJsonSchema

from kvmesh.services.controller.lookup import KeyRequest

# vLLM's token ids are int32; a bound well inside float precision also keeps JSON clients honest.
MAX_TOKEN_ID = 2**31 - 1


def _integral_float_to_int(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer: accept it as 1 (but never "1", true or 1.5)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# (The bounds must come before the BeforeValidator, or pydantic cannot put them in the JSON schema.)
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKEN_ID, description="a token id"),
                    BeforeValidator(_integral_float_to_int)]
Location = Literal["LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"]
MAX_INSTANCE_ID = 256
InstanceId = Annotated[str, Field(min_length=1, max_length=MAX_INSTANCE_ID, examples=["lmcache_default_instance"],
                                  description="lmcache_instance_id of an engine instance")]
EXAMPLE_TOKENS = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]
# Optional key inputs (LMCache's JSON stays valid without them): the chunks of a request sent with vLLM's
# `cache_salt`, or with a LoRA adapter, are keyed with it, so a lookup or pin of them must name it too.
MAX_CACHE_SALT = 128  # vLLM's own bound on cache_salt
MAX_LORA_NAME = 256
CacheSalt = Annotated[str | None, Field(default=None, min_length=1, max_length=MAX_CACHE_SALT,
                                        description="the cache_salt the requests were sent with")]
LoraName = Annotated[str | None, Field(default=None, min_length=1, max_length=MAX_LORA_NAME,
                                       description="the LoRA adapter (vLLM's model name) the requests used")]


class LookupRequest(BaseModel):
    tokens: list[TokenId] = Field(examples=[EXAMPLE_TOKENS])
    cache_salt: CacheSalt = None
    lora_name: LoraName = None


# [location, matched_prefix_len]. Declared without `prefixItems` (pydantic's tuple schema), which some
# OpenAPI tools still misread.
LayoutEntry = Annotated[tuple[Location, int], WithJsonSchema({
    "type": "array", "minItems": 2, "maxItems": 2, "description": "[location, matched_prefix_len]",
    "items": {"anyOf": [{"type": "string", "enum": ["LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"]},
                        {"type": "integer", "minimum": 0}]}})]


class LookupResponse(BaseModel):
    event_id: str
    layout_info: dict[str, LayoutEntry] = Field(
        description="instance_id -> [best location, matched prefix length in tokens]; matching instances only",
        examples=[{"lmcache_default_instance": ["LocalCPUBackend", 12]}])


class PinRequest(BaseModel):
    instance_id: InstanceId
    location: Location
    tokens: list[TokenId] = Field(examples=[EXAMPLE_TOKENS])
    cache_salt: CacheSalt = None
    lora_name: LoraName = None

    def key_request(self) -> KeyRequest:
        return KeyRequest(self.cache_salt, self.lora_name)


class PrefetchRequest(BaseModel):
    """/pin's body: the prefix of `tokens` the instance holds below its CPU tier starts moving into it."""

    instance_id: InstanceId
    location: Literal["LocalCPUBackend"] = Field(default="LocalCPUBackend",
                                                 description="the tier warmed: the CPU tier, the only one")
    tokens: list[TokenId] = Field(examples=[EXAMPLE_TOKENS])
    cache_salt: CacheSalt = None
    lora_name: LoraName = None

    def key_request(self) -> KeyRequest:
        return KeyRequest(self.cache_salt, self.lora_name)


class ClearRequest(BaseModel):
    instance_id: InstanceId
    location: Location


class CommandResponse(BaseModel):
    event_id: str
    num_tokens: int = Field(description="tokens actually pinned / unpinned / cleared; for /prefetch the held prefix "
                                        "now in or on its way to the CPU tier (minimum over ranks)")


class CheckFinishRequest(BaseModel):
    event_id: str = Field(min_length=1, max_length=128)


class CheckFinishResponse(BaseModel):
    status: Literal["finished", "pending", "failed"]
    error: str | None = None


class HealthRequest(BaseModel):
    instance_id: InstanceId


class WorkerHealth(BaseModel):
    rank: int | None
    alive: bool
    last_heartbeat_age_s: float


class StoreHealth(BaseModel):
    location: str
    registered: bool
    alive: bool


class HealthResponse(BaseModel):
    event_id: str
    instance_id: str
    healthy: bool
    world_size: int
    error_codes: dict[int, int] = Field(description="rank -> 0 healthy; 1 no heartbeat within --liveness-timeout; "
                                                    "2 not registered")
    workers: dict[str, WorkerHealth]
    stores: dict[str, StoreHealth]


class QueryWorkerInfoRequest(BaseModel):
    instance_id: InstanceId = Field(description='an instance id, or "all" for every instance')
    worker_ids: list[Annotated[int, Strict(), Field(ge=0, le=1_000_000), BeforeValidator(_integral_float_to_int)]] | None = Field(
        default=None, description="ranks to report (default, or []: all registered)")


class WorkerInfo(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    instance_id: str
    worker_id: int = Field(description="the worker's rank")
    ip: str | None = Field(description="the address the worker reaches the mesh from")
    port: int | None = Field(description="always null: the controller reaches workers over NATS, not a port")
    peer_init_url: str | None = Field(description="host:port of the worker's P2P stream (its CPU tier served to the "
                                                  "peers of its sharing domain); null without enable_p2p")
    registration_time: float | None = Field(description="Unix time of the worker's latest registration")
    last_heartbeat_time: float = Field(description="Unix time the worker was last heard from")
    worker_name: str = Field(description="the worker's producer id on the mesh (unique per engine process)")
    host: str | None
    model: str
    kv_format: str
    world_size: int
    rank: int
    chunk_size: int
    save_unfull_chunk: bool
    disk_store: str | None
    remote_stores: list[str]
    started_at: float
    last_heartbeat_age_s: float
    alive: bool
    num_keys: int
    last_seq: int | None
    in_sync: bool


class QueryWorkerInfoResponse(BaseModel):
    event_id: str
    worker_infos: list[WorkerInfo]


class QueryInstanceRequest(BaseModel):
    ip: str = Field(min_length=1, max_length=255, examples=["127.0.0.1"])


class QueryInstanceResponse(BaseModel):
    event_id: str
    res: str = Field(description="the instance id of the workers at that ip")


# [instance_id, location] (the command checks the location, and names what is wrong)
_PositionPart = Annotated[str, Field(min_length=1, max_length=256)]
Position = Annotated[tuple[_PositionPart, _PositionPart], WithJsonSchema({
    "type": "array", "minItems": 2, "maxItems": 2, "description": "[instance_id, location]",
    "items": {"type": "string", "minLength": 1, "maxLength": 256}})]


class MoveRequest(BaseModel):
    old_position: Position
    new_position: Position
    tokens: list[TokenId] = Field(default_factory=list, examples=[EXAMPLE_TOKENS])
    should_copy: bool = False
    cache_salt: CacheSalt = None
    lora_name: LoraName = None


class CompressRequest(BaseModel):
    instance_id: InstanceId
    method: str = Field(min_length=1, max_length=64)
    location: Location
    tokens: list[TokenId] = Field(default_factory=list)


class InstanceInfo(BaseModel):
    instance_id: str
    alive: bool
    locations: list[str]
    workers: list[WorkerInfo] = Field(description="the workers serving the instance id, one per rank")
    duplicate_workers: list[WorkerInfo] = Field(
        description="other live workers claiming this instance id and rank (replicas sharing an "
                    "lmcache_instance_id): reported, never merged; the instance id is not served from them")


class StoreInfo(BaseModel):
    store_id: str
    location: str | None
    alive: bool
    registered: bool
    num_keys: int
    last_heartbeat_age_s: float
    in_sync: bool


class InstancesResponse(BaseModel):
    controller_id: str
    num_keys: int
    instances: list[InstanceInfo]
    stores: list[StoreInfo]


class UsageFigures(BaseModel):
    """One producer's figures, or several summed (services/controller/usage.py)."""
    producers: int = Field(description="producers behind these figures (workers or stores)")
    reporting: int = Field(description="how many of them answered with their own figures within --usage-timeout")
    num_chunks: int = Field(description="chunks they hold in the controller's index (their admissions as applied)")
    reported_chunks: int | None = Field(description="chunks they hold by their own count; null unless every one "
                                                    "answered (so are the figures below)")
    used_bytes: int | None
    capacity_bytes: int | None
    pinned_chunks: int | None
    hits: int | None = Field(description="reads that found their chunk, since each producer started")
    evictions: int | None = Field(description="chunks evicted to make room, since each producer started (not "
                                              "removals, clears or wipes)")
    retains_refused: int | None = Field(description="requests' retentions (kv_priority, leases) not taken since "
                                                    "each producer started: past the CPU tier's retained_cpu_share "
                                                    "or a store's --retained-share the chunk is held as any other")
    usage_ratio: float | None = Field(description="used_bytes / capacity_bytes; null when either is unknown or 0")


class UsageModule(UsageFigures):
    tier: str = Field(description='"l1" (an instance\'s CPU tier) or "l2" (a store), as LMCache names them')
    backend: str | None = Field(description="the location: LocalCPUBackend, LocalDiskBackend or RemoteBackend")
    shared: bool = Field(description="a store's totals, shared with every instance that uses it (never split)")
    store_ids: list[str] = Field(description="the stores behind a shared module; [] for the CPU tier")


class UsageWorker(UsageFigures):
    worker_id: str
    rank: int
    alive: bool


class InstanceUsage(BaseModel):
    instance_id: str
    registered: bool
    alive: bool
    domain: str = Field(description="the instance's sharing domain")
    modules: list[UsageModule]
    workers: list[UsageWorker] = Field(description="the CPU tier of each worker (rank); [] when `location` names "
                                                   "a store")


class StoreUsage(UsageFigures):
    tier: str
    backend: str | None
    shared: bool
    store_id: str
    alive: bool
    registered: bool


class DomainUsage(BaseModel):
    domain: str
    instance_ids: list[str]
    modules: list[UsageModule] = Field(description="the CPU tiers of the domain's instances summed, then the "
                                                   "stores they use")


class UsageResponse(BaseModel):
    controller_id: str
    instances: list[InstanceUsage]
    shared_modules: list[StoreUsage] = Field(description="each store (of the instance, with instance_id)")
    domains: list[DomainUsage]


class ErrorResponse(BaseModel):
    detail: str
    event_id: str | None = None


class HealthzResponse(BaseModel):
    status: str
    controller_id: str
    nats_connected: bool


class ValidationErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorResponse(BaseModel):
    detail: list[ValidationErrorItem]
