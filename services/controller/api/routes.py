"""The controller's routes: each endpoint a named function on `router`, calling the `ControllerCore` of its app.

`create_app` (app.py) includes `router`, keeps the core in `app.state.core` (and the /lookup handler it shares
with the Gate in `app.state.handle_lookup`) and registers the two error handlers below.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.services.controller.api.lookup_body import validation_error
from kvmesh.services.controller.api.metrics_page import render as render_metrics
from kvmesh.services.controller.api.schemas import (
    CheckFinishRequest, CheckFinishResponse, ClearRequest, CommandResponse, CompressRequest, ErrorResponse,
    HealthRequest, HealthResponse, HealthzResponse, InstancesResponse, LookupRequest, LookupResponse, MoveRequest,
    MAX_INSTANCE_ID, Location, PinRequest, PrefetchRequest, QueryInstanceRequest, QueryInstanceResponse,
    QueryWorkerInfoRequest, QueryWorkerInfoResponse, UsageResponse, ValidationErrorResponse)
from kvmesh.services.controller.core import ControllerCore
from kvmesh.services.controller.errors import ControllerError
from kvmesh.services.controller.lookup import KeyRequest

CODEC_UNSUPPORTED = ("/{op} is not supported by KVMesh: chunks are kept in the KV layout vLLM gives them (LMCache's "
                     "remote_serde 'naive'); there is no codec (cachegen, kivi) to {op} them with")

# The error answers each route declares in the OpenAPI document.
ERRORS = {404: {"model": ErrorResponse, "description": "unknown instance, location or event"},
          413: {"model": ErrorResponse, "description": "too many tokens"}}
COMMAND_ERRORS = {**ERRORS, 429: {"model": ErrorResponse, "description": "too many commands in flight (--max-commands)"},
                  502: {"model": ErrorResponse, "description": "a worker answered with an error"},
                  503: {"model": ErrorResponse, "description": "the controller is not connected to NATS"},
                  504: {"model": ErrorResponse, "description": "a worker did not answer in time"}}
MOVE_ERRORS = {**COMMAND_ERRORS, 409: {"model": ErrorResponse, "description": "a move to the same location, out of a "
                                                                              "shared store (copy instead), or between "
                                                                              "instances that cannot share over P2P"}}
NOT_IMPLEMENTED = {501: {"model": ErrorResponse, "description": "not supported by KVMesh (the detail says why)"}}


def controller_core(request: Request) -> ControllerCore:
    """The core the app serves (set by `create_app`)."""
    return request.app.state.core


Core = Annotated[ControllerCore, Depends(controller_core)]
router = APIRouter()


def error_response(status: int, detail: str, event_id: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"detail": detail}
    if event_id is not None:
        body["event_id"] = event_id
    return JSONResponse(body, status_code=status)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # FastAPI answers 400 for a body it cannot even decode (e.g. not UTF-8): for us that is one more
    # malformed body, 422 like any other.
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        return validation_error([{"type": "json_invalid", "loc": ["body"], "msg": "body is not valid JSON"}])
    return await http_exception_handler(request, exc)


async def on_controller_error(_request: Request, exc: ControllerError) -> JSONResponse:
    return error_response(exc.status_code, exc.message, getattr(exc, "event_id", None))


def _too_many(core: ControllerCore, num_tokens: int) -> JSONResponse | None:
    max_tokens = core.config.max_tokens
    if num_tokens > max_tokens:
        return error_response(413, f"{num_tokens} tokens exceed the limit of {max_tokens} (--max-tokens)")
    return None


async def _command(core: ControllerCore, op: str, instance_id: str, location: str, tokens: list[int],
                   key_request: KeyRequest = KeyRequest()) -> CommandResponse | JSONResponse:
    refused = _too_many(core, len(tokens))
    if refused is not None:
        return refused
    result = await core.command(op, instance_id, location, tokens, key_request)
    return CommandResponse(event_id=result.event_id, num_tokens=result.num_tokens)


@router.post("/lookup", response_model=LookupResponse,
             responses={413: ERRORS[413], 422: {"model": ValidationErrorResponse, "description": "Validation Error"}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": LookupRequest.model_json_schema()}}}})
async def lookup(request: Request) -> Response:
    """Which instances hold the longest prefix of `tokens`, and at which location."""
    status, payload = request.app.state.handle_lookup(await request.body())
    return Response(payload, status_code=status, media_type="application/json")


@router.post("/pin", response_model=CommandResponse, responses=COMMAND_ERRORS)
async def pin(req: PinRequest, core: Core) -> Any:
    """Pin the chunks of `tokens` at `location` of the instance, until unpinned."""
    return await _command(core, "pin", req.instance_id, req.location, req.tokens, req.key_request())


@router.post("/unpin", response_model=CommandResponse, responses=COMMAND_ERRORS)
async def unpin(req: PinRequest, core: Core) -> Any:
    """Release pins on the chunks of `tokens` at `location` of the instance."""
    return await _command(core, "unpin", req.instance_id, req.location, req.tokens, req.key_request())


@router.post("/prefetch", response_model=CommandResponse, responses=COMMAND_ERRORS)
async def prefetch(req: PrefetchRequest, core: Core) -> Any:
    """Warm the instance's CPU tier: the prefix of `tokens` it holds (CPU tier and below) starts moving from its
    lower tiers into the CPU tier; num_tokens: that prefix, minimum over ranks. The event finishes once every
    worker has started the moves (their arrival shows in /lookup at LocalCPUBackend)."""
    return await _command(core, "prefetch", req.instance_id, req.location, req.tokens, req.key_request())


@router.post("/clear", response_model=CommandResponse, responses=COMMAND_ERRORS)
async def clear(req: ClearRequest, core: Core) -> Any:
    """Remove every chunk the instance holds at `location`."""
    return await _command(core, "clear", req.instance_id, req.location, [])


@router.post("/check_finish", response_model=CheckFinishResponse, response_model_exclude_none=True,
             responses={404: ERRORS[404]})
async def check_finish(req: CheckFinishRequest, core: Core) -> Any:
    """Status of an operation by the event_id it returned."""
    record = core.check_finish(req.event_id)
    return CheckFinishResponse(status=record.status, error=record.error)


@router.post("/health", response_model=HealthResponse, responses={404: ERRORS[404]})
async def health(req: HealthRequest, core: Core) -> Any:
    """Liveness of an instance's workers (by heartbeat) and of its stores."""
    info = core.health(req.instance_id)
    return {"event_id": core.events.new("health", status="finished"), **info}


@router.post("/query_worker_info", response_model=QueryWorkerInfoResponse, responses={404: ERRORS[404]})
async def query_worker_info(req: QueryWorkerInfoRequest, core: Core) -> Any:
    """Registration and liveness of an instance's workers (all, or the ranks in worker_ids)."""
    infos = core.query_worker_info(req.instance_id, req.worker_ids)
    return {"event_id": core.events.new("query_worker_info", status="finished"), "worker_infos": infos}


@router.post("/query_instance", response_model=QueryInstanceResponse, responses={404: ERRORS[404]})
async def query_instance(req: QueryInstanceRequest, core: Core) -> Any:
    """The instance whose engine workers report this ip."""
    instance_id = core.query_instance(req.ip)
    return {"event_id": core.events.new("query_instance", status="finished"), "res": instance_id}


@router.post("/move", response_model=CommandResponse, responses=MOVE_ERRORS)
async def move(req: MoveRequest, core: Core) -> Any:
    """Copy (should_copy) or move the instance's chunks of `tokens` from one of its locations to another;
    num_tokens: the contiguous prefix that arrived (minimum over ranks). Only the CPU tier can be moved out
    of (a store is shared). Between instances (both with enable_p2p, one sharing domain, the same ranks) the
    target streams the chunks from the source's CPU tier, rank for rank."""
    refused = _too_many(core, len(req.tokens))
    if refused is not None:
        return refused
    result = await core.move(req.old_position, req.new_position, req.tokens, req.should_copy,
                             KeyRequest(req.cache_salt, req.lora_name))
    return CommandResponse(event_id=result.event_id, num_tokens=result.num_tokens)


@router.post("/compress", status_code=501, responses=NOT_IMPLEMENTED)
async def compress(req: CompressRequest, core: Core) -> JSONResponse:
    """LMCache's compression of stored chunks: not supported."""
    return _too_many(core, len(req.tokens)) or error_response(501, CODEC_UNSUPPORTED.format(op="compress"))


@router.post("/decompress", status_code=501, responses=NOT_IMPLEMENTED)
async def decompress(req: CompressRequest, core: Core) -> JSONResponse:
    """LMCache's decompression of stored chunks: not supported."""
    return _too_many(core, len(req.tokens)) or error_response(501, CODEC_UNSUPPORTED.format(op="decompress"))


@router.get("/instances", response_model=InstancesResponse)
async def instances(core: Core) -> Any:
    """Every registered instance and store."""
    return core.instances()


USAGE_ERRORS = {404: ERRORS[404], 429: {"model": ErrorResponse, "description": "too many /usage requests in flight "
                                                                            "(--max-usage-requests)"},
                422: {"model": ValidationErrorResponse, "description": "a bad query parameter (named)"}}


async def _usage(core: ControllerCore, instance_id: str | None, location: str | None) -> dict[str, Any]:
    return {"controller_id": core.controller_id, **await core.usage.answer(instance_id, location)}


@router.get("/usage", response_model=UsageResponse, responses=USAGE_ERRORS)
async def usage(core: Core, instance_id: Annotated[str | None, Query(min_length=1, max_length=MAX_INSTANCE_ID)] = None,
                location: Annotated[Location | None, Query()] = None) -> Any:
    """Chunks, bytes, pins, hits and evictions per instance (and worker), tier, store and sharing domain; for one
    instance and / or one location when asked."""
    return await _usage(core, instance_id, location)


@router.get("/instances/usage", response_model=UsageResponse, responses=USAGE_ERRORS)
async def instances_usage(core: Core, location: Annotated[Location | None, Query()] = None) -> Any:
    """/usage at LMCache's coordinator path."""
    return await _usage(core, None, location)


@router.get("/instances/{instance_id}/usage", response_model=UsageResponse, responses=USAGE_ERRORS)
async def instance_usage(core: Core, instance_id: Annotated[str, Path(min_length=1, max_length=MAX_INSTANCE_ID)],
                         location: Annotated[Location | None, Query()] = None) -> Any:
    """/usage?instance_id= at LMCache's coordinator path: 404 for an instance the controller does not know."""
    return await _usage(core, instance_id, location)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(core: Core) -> PlainTextResponse:
    """Prometheus metrics."""
    return PlainTextResponse(render_metrics(core), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/healthz", response_model=HealthzResponse)
async def healthz(core: Core) -> Any:
    """The REST server itself (no auth)."""
    return {"status": "ok", "controller_id": core.controller_id, "nats_connected": core.nats_connected()}
