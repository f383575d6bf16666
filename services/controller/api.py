"""The controller's REST API (FastAPI; served by uvicorn on the controller's event loop, see service.py).

LMCache's controller endpoints, all POST with JSON bodies: /lookup, /pin, /clear, /check_finish, /health,
/query_worker_info (instance_id "all": every instance), /query_instance, /move (within an instance, or between
two instances with enable_p2p over their peer streams); /compress and /decompress check their body and answer 501 naming what KVMesh lacks; ours in
addition: POST /unpin, GET /instances, GET /metrics (Prometheus text),
GET /healthz (the REST server itself; always open), OpenAPI at /openapi.json and /docs.

Input rules: malformed bodies are 422 naming the field (a value nested deeper than MAX_JSON_DEPTH too, before
any JSON parser recurses into it), token lists longer than `max_tokens` are 413 (bodies too large to hold that
many are refused before they are read, and the stream is cut as soon as it passes the limit), a missing or wrong
bearer token is 401 when auth is on (checked before the body is read). Bodies over --large-body-bytes are read
--max-large-bodies at a time, --large-body-queue more wait unread, the rest get 503 with Retry-After (`BodySlots`,
shared/http_gate.py):
each holds its parsed token list until answered, so this bounds the controller's memory. /lookup is the hot path: its body is checked by msgspec and its token list parsed by numpy
straight into the int64 array the hasher reads (see `_fast_tokens`), with the same rules as the schema the
OpenAPI document declares (~4x faster than FastAPI's json + pydantic for an 8k-token body here).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Scope, Send

from kvmesh.services.controller import metrics as metrics_text
from kvmesh.services.controller.core import ControllerCore
from kvmesh.services.controller.errors import ControllerError
from kvmesh.services.controller.lookup import KeyRequest
from kvmesh.shared.http_gate import BodyGate, BodySlots, send_bytes

# vLLM's token ids are int32; a bound well inside float precision also keeps JSON clients honest.
MAX_TOKEN_ID = 2**31 - 1
# Open even with auth on: the REST server's own health, and the API's documentation.
OPEN_PATHS = frozenset({"/healthz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def _integral_float_to_int(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer: accept it as 1 (but never "1", true or 1.5)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# (The bounds must come before the BeforeValidator, or pydantic cannot put them in the JSON schema.)
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKEN_ID, description="a token id"),
                    BeforeValidator(_integral_float_to_int)]
Location = Literal["LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"]
InstanceId = Annotated[str, Field(min_length=1, max_length=256, examples=["lmcache_default_instance"],
                                  description="lmcache_instance_id of an engine instance")]
CODEC_UNSUPPORTED = ("/{op} is not supported by KVMesh: chunks are kept in the KV layout vLLM gives them (LMCache's "
                     "remote_serde 'naive'); there is no codec (cachegen, kivi) to {op} them with")
EXAMPLE_TOKENS = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]
# Optional key inputs (LMCache's JSON stays valid without them): the chunks of a request sent with vLLM's
# `cache_salt`, or with a LoRA adapter, are keyed with it, so a lookup or pin of them must name it too.
MAX_CACHE_SALT = 128  # vLLM's own bound on cache_salt
MAX_LORA_NAME = 256
CacheSalt = Annotated[str | None, Field(default=None, min_length=1, max_length=MAX_CACHE_SALT,
                                        description="the cache_salt the requests were sent with")]
LoraName = Annotated[str | None, Field(default=None, min_length=1, max_length=MAX_LORA_NAME,
                                       description="the LoRA adapter (vLLM's model name) the requests used")]


# -------------------------------------------------------------------------------------------------------
# Request and response bodies


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


class ClearRequest(BaseModel):
    instance_id: InstanceId
    location: Location


class CommandResponse(BaseModel):
    event_id: str
    num_tokens: int = Field(description="tokens actually pinned / unpinned / cleared (minimum over ranks)")


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


# The /lookup hot path. msgspec checks the body is well-formed JSON and hands back `tokens` as raw bytes;
# when those are a plain list of non-negative integer literals (what every client sends), numpy parses
# them straight into the int64 array the hasher needs: ~3x faster than decoding 8k Python ints and packing
# them again. Anything else (floats, negatives, strings, nesting...) takes the exact path below, which
# either accepts it (1.0 counts as 1, as in JSON Schema) or names the bad field in a 422.
_MsgspecSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None
_MsgspecLora = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LORA_NAME)] | None


class _RawLookupBody(msgspec.Struct):
    tokens: msgspec.Raw
    cache_salt: _MsgspecSalt = None
    lora_name: _MsgspecLora = None


class _LookupBody(msgspec.Struct):
    tokens: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]]
    cache_salt: _MsgspecSalt = None
    lora_name: _MsgspecLora = None


class _LaxLookupBody(msgspec.Struct):
    tokens: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)] | float]
    cache_salt: _MsgspecSalt = None
    lora_name: _MsgspecLora = None


_RAW_LOOKUP_DECODER = msgspec.json.Decoder(_RawLookupBody)
_LOOKUP_DECODER = msgspec.json.Decoder(_LookupBody)
_LAX_LOOKUP_DECODER = msgspec.json.Decoder(_LaxLookupBody)
_ENCODER = msgspec.json.Encoder()
_MSGSPEC_PATH = re.compile(r"\.([A-Za-z_][\w]*)|\[(\d+)\]")
_INTEGER_LIST_CHARS = b"0123456789, \t\r\n"
_COMMA = ord(",")
_NO_TOKENS = np.zeros(0, dtype="<i8")


def _error(status: int, detail: str, event_id: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"detail": detail}
    if event_id is not None:
        body["event_id"] = event_id
    return JSONResponse(body, status_code=status)


def _fast_tokens(body: bytes) -> tuple[np.ndarray, KeyRequest] | None:
    """The tokens of a well-formed body whose `tokens` is a list of in-range integer literals; else None."""
    try:
        decoded = _RAW_LOOKUP_DECODER.decode(body)
    except msgspec.DecodeError:
        return None
    raw = bytes(decoded.tokens)
    key_request = KeyRequest(decoded.cache_salt, decoded.lora_name)
    if raw[:1] != b"[" or raw[-1:] != b"]":
        return None
    inner = raw[1:-1]
    if inner.translate(None, _INTEGER_LIST_CHARS):
        return None  # a sign, a fraction, an exponent, a string, a nested value...
    if not inner.strip():
        return _NO_TOKENS, key_request
    # JSON syntax is already checked (no empty items, no leading zeros); out-of-range literals clamp to
    # int64 max, which the bound below refuses.
    tokens = np.fromstring(inner, dtype="<i8", sep=",")
    num_commas = int(np.count_nonzero(np.frombuffer(inner, dtype=np.uint8) == _COMMA))  # 5x bytes.count here
    if len(tokens) != num_commas + 1 or int(tokens.max()) > MAX_TOKEN_ID:
        return None
    return tokens, key_request


def _decode_lookup(body: bytes) -> tuple[np.ndarray | list[int], KeyRequest] | Response:
    """The token ids and key inputs of a /lookup body, or the 422 response saying which field is wrong."""
    fast = _fast_tokens(body)
    if fast is not None:
        return fast
    try:
        strict = _LOOKUP_DECODER.decode(body)
        return strict.tokens, KeyRequest(strict.cache_salt, strict.lora_name)
    except msgspec.DecodeError as exc:
        if not isinstance(exc, msgspec.ValidationError):
            return _msgspec_422(exc, "json_invalid")
        strict_error = exc
    try:
        lax = _LAX_LOOKUP_DECODER.decode(body)
    except msgspec.DecodeError:
        return _msgspec_422(strict_error, "value_error")
    lax_tokens: list[int] = []
    for index, value in enumerate(lax.tokens):
        if isinstance(value, float):
            if not (value.is_integer() and 0 <= value <= MAX_TOKEN_ID):
                return _422([{"type": "value_error", "loc": ["body", "tokens", index],
                              "msg": f"Expected an integer token id in [0, {MAX_TOKEN_ID}], got {value!r}"}])
            value = int(value)
        lax_tokens.append(value)
    return lax_tokens, KeyRequest(lax.cache_salt, lax.lora_name)


def _422(errors: list[dict[str, Any]]) -> Response:
    return Response(_ENCODER.encode({"detail": errors}), status_code=422, media_type="application/json")


def _msgspec_422(exc: Exception, kind: str) -> Response:
    """A msgspec error as FastAPI's 422 shape: {"detail": [{"type", "loc": ["body", field, index], "msg"}]}."""
    text = str(exc)
    message, _, where = text.partition(" - at `$")
    loc: list[str | int] = ["body"]
    for name, index in _MSGSPEC_PATH.findall(where.rstrip("`")):
        loc.append(name if name else int(index))
    return _422([{"type": kind, "loc": loc, "msg": message}])


# -------------------------------------------------------------------------------------------------------
# The gate: auth, body size, and the /lookup hot path (plain ASGI, in front of FastAPI)

LookupHandler = Callable[[bytes], tuple[int, bytes]]


def lookup_handler(core: ControllerCore) -> LookupHandler:
    """body -> (status, JSON bytes) for /lookup: one function for the hot path and the FastAPI route."""
    max_tokens = core.config.max_tokens

    def handle(body: bytes) -> tuple[int, bytes]:
        decoded = _decode_lookup(body)
        if isinstance(decoded, Response):
            return decoded.status_code, bytes(decoded.body)
        tokens, key_request = decoded
        if len(tokens) > max_tokens:
            return 413, _ENCODER.encode({"detail": f"{len(tokens)} tokens exceed the limit of {max_tokens} "
                                                   "(--max-tokens)"})
        event_id, layout = core.lookup(tokens, key_request)
        return 200, _ENCODER.encode({"event_id": event_id, "layout_info": layout})

    return handle


# JSON nested deeper than this is refused (422 naming the field) before a parser sees it: no endpoint takes more
# than 2 levels, and the parsers recurse (a few thousand levels made /lookup a 500 with RecursionError).
MAX_JSON_DEPTH = 32


class Gate(BodyGate):
    """The controller's `BodyGate` (shared/http_gate.py: 401 without the token when one is configured, 413 past
    `max_body`, a turn for large bodies, 422 for bodies nested too deep), with POST /lookup answered right here.

    /lookup is the one hot endpoint; serving it at the ASGI layer skips FastAPI's routing, dependency solving
    and Request/Response objects (~150 us of a ~500 us lookup on these cores). Its FastAPI route stays: it
    declares the operation in the OpenAPI document and calls the same handler.
    """

    def __init__(self, app: ASGIApp, token: str | None, max_body: int, lookup: LookupHandler | None = None,
                 large_body: int = 1 << 20, large_bodies: BodySlots | None = None) -> None:
        super().__init__(app, token=token, max_body=max_body, large_body=large_body,
                         large_bodies=large_bodies or BodySlots(2, 32), max_depth=MAX_JSON_DEPTH,
                         open_paths=OPEN_PATHS, max_body_hint="see --max-tokens",
                         expected_json="e.g. a list of token ids")
        self.lookup = lookup

    async def answer(self, scope: Scope, body: bytes, send: Send) -> bool:
        if self.lookup is None or scope["path"] != "/lookup" or scope["method"] != "POST":
            return False
        status, payload = self.lookup(body)
        await send_bytes(send, status, payload)
        return True


# -------------------------------------------------------------------------------------------------------
# The app


def create_app(core: ControllerCore, lookup_fast_path: bool = True) -> FastAPI:
    """The FastAPI app over one ControllerCore, behind the Gate (auth, size limit; /lookup served there
    unless `lookup_fast_path` is False, then by its FastAPI route)."""
    config = core.config
    max_tokens = config.max_tokens
    handle_lookup = lookup_handler(core)
    app = FastAPI(title="KVMesh controller", version="1",
                  description="LMCache-compatible KV cache controller: lookup, pin, unpin, clear, check_finish, "
                              "health and worker info over an index built from NATS events.")
    errors = {404: {"model": ErrorResponse, "description": "unknown instance, location or event"},
              413: {"model": ErrorResponse, "description": "too many tokens"}}
    command_errors = {**errors, 429: {"model": ErrorResponse, "description": "too many commands in flight (--max-commands)"},
                      502: {"model": ErrorResponse, "description": "a worker answered with an error"},
                      503: {"model": ErrorResponse, "description": "the controller is not connected to NATS"},
                      504: {"model": ErrorResponse, "description": "a worker did not answer in time"}}

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI answers 400 for a body it cannot even decode (e.g. not UTF-8): for us that is one more
        # malformed body, 422 like any other.
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            return _422([{"type": "json_invalid", "loc": ["body"], "msg": "body is not valid JSON"}])
        return await http_exception_handler(request, exc)

    @app.exception_handler(ControllerError)
    async def on_controller_error(_request: Request, exc: ControllerError) -> JSONResponse:
        return _error(exc.status_code, exc.message, getattr(exc, "event_id", None))

    def too_many(num_tokens: int) -> JSONResponse | None:
        if num_tokens > max_tokens:
            return _error(413, f"{num_tokens} tokens exceed the limit of {max_tokens} (--max-tokens)")
        return None

    @app.post("/lookup", response_model=LookupResponse,
              responses={413: errors[413], 422: {"model": ValidationErrorResponse, "description": "Validation Error"}},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": LookupRequest.model_json_schema()}}}})
    async def lookup(request: Request) -> Response:
        """Which instances hold the longest prefix of `tokens`, and at which location."""
        status, payload = handle_lookup(await request.body())
        return Response(payload, status_code=status, media_type="application/json")

    async def command(op: str, instance_id: str, location: str, tokens: list[int],
                      key_request: KeyRequest = KeyRequest()) -> CommandResponse | JSONResponse:
        refused = too_many(len(tokens))
        if refused is not None:
            return refused
        result = await core.command(op, instance_id, location, tokens, key_request)
        return CommandResponse(event_id=result.event_id, num_tokens=result.num_tokens)

    @app.post("/pin", response_model=CommandResponse, responses=command_errors)
    async def pin(req: PinRequest) -> Any:
        """Pin the chunks of `tokens` at `location` of the instance, until unpinned."""
        return await command("pin", req.instance_id, req.location, req.tokens, req.key_request())

    @app.post("/unpin", response_model=CommandResponse, responses=command_errors)
    async def unpin(req: PinRequest) -> Any:
        """Release pins on the chunks of `tokens` at `location` of the instance."""
        return await command("unpin", req.instance_id, req.location, req.tokens, req.key_request())

    @app.post("/clear", response_model=CommandResponse, responses=command_errors)
    async def clear(req: ClearRequest) -> Any:
        """Remove every chunk the instance holds at `location`."""
        return await command("clear", req.instance_id, req.location, [])

    @app.post("/check_finish", response_model=CheckFinishResponse, response_model_exclude_none=True,
              responses={404: errors[404]})
    async def check_finish(req: CheckFinishRequest) -> Any:
        """Status of an operation by the event_id it returned."""
        record = core.check_finish(req.event_id)
        return CheckFinishResponse(status=record.status, error=record.error)

    @app.post("/health", response_model=HealthResponse, responses={404: errors[404]})
    async def health(req: HealthRequest) -> Any:
        """Liveness of an instance's workers (by heartbeat) and of its stores."""
        info = core.health(req.instance_id)
        return {"event_id": core.events.new("health", status="finished"), **info}

    @app.post("/query_worker_info", response_model=QueryWorkerInfoResponse, responses={404: errors[404]})
    async def query_worker_info(req: QueryWorkerInfoRequest) -> Any:
        """Registration and liveness of an instance's workers (all, or the ranks in worker_ids)."""
        infos = core.query_worker_info(req.instance_id, req.worker_ids)
        return {"event_id": core.events.new("query_worker_info", status="finished"), "worker_infos": infos}

    @app.post("/query_instance", response_model=QueryInstanceResponse, responses={404: errors[404]})
    async def query_instance(req: QueryInstanceRequest) -> Any:
        """The instance whose engine workers report this ip."""
        instance_id = core.query_instance(req.ip)
        return {"event_id": core.events.new("query_instance", status="finished"), "res": instance_id}

    not_implemented = {501: {"model": ErrorResponse, "description": "not supported by KVMesh (the detail says why)"}}

    @app.post("/move", response_model=CommandResponse, responses={
        **command_errors, 409: {"model": ErrorResponse, "description": "a move to the same location, out of a "
                                                                         "shared store (copy instead), or between "
                                                                         "instances that cannot share over P2P"}})
    async def move(req: MoveRequest) -> Any:
        """Copy (should_copy) or move the instance's chunks of `tokens` from one of its locations to another;
        num_tokens: the contiguous prefix that arrived (minimum over ranks). Only the CPU tier can be moved out
        of (a store is shared). Between instances (both with enable_p2p, one sharing domain, the same ranks) the
        target streams the chunks from the source's CPU tier, rank for rank."""
        refused = too_many(len(req.tokens))
        if refused is not None:
            return refused
        result = await core.move(req.old_position, req.new_position, req.tokens, req.should_copy,
                                 KeyRequest(req.cache_salt, req.lora_name))
        return CommandResponse(event_id=result.event_id, num_tokens=result.num_tokens)

    @app.post("/compress", status_code=501, responses=not_implemented)
    async def compress(req: CompressRequest) -> JSONResponse:
        """LMCache's compression of stored chunks: not supported."""
        return too_many(len(req.tokens)) or _error(501, CODEC_UNSUPPORTED.format(op="compress"))

    @app.post("/decompress", status_code=501, responses=not_implemented)
    async def decompress(req: CompressRequest) -> JSONResponse:
        """LMCache's decompression of stored chunks: not supported."""
        return too_many(len(req.tokens)) or _error(501, CODEC_UNSUPPORTED.format(op="decompress"))

    @app.get("/instances", response_model=InstancesResponse)
    async def instances() -> Any:
        """Every registered instance and store."""
        return core.instances()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus metrics."""
        return PlainTextResponse(metrics_text.render(core), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz", response_model=HealthzResponse)
    async def healthz() -> Any:
        """The REST server itself (no auth)."""
        return {"status": "ok", "controller_id": core.controller_id, "nats_connected": core.nats_connected()}

    if config.auth_token:
        _document_bearer_auth(app)
    app.add_middleware(Gate, token=config.auth_token, max_body=config.max_body_bytes(),
                       lookup=handle_lookup if lookup_fast_path else None, large_body=config.large_body_bytes,
                       large_bodies=BodySlots(config.max_large_bodies, config.large_body_queue))
    return app


def _document_bearer_auth(app: FastAPI) -> None:
    """Declare the bearer scheme in the OpenAPI document (the Gate enforces it), so /docs can send it."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearerAuth"] = {
                "type": "http", "scheme": "bearer"}
            for path, operations in schema.get("paths", {}).items():
                if path in OPEN_PATHS:
                    continue
                for operation in operations.values():
                    operation["security"] = [{"bearerAuth": []}]
                    operation.setdefault("responses", {})["401"] = {"description": "missing or wrong bearer token"}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
