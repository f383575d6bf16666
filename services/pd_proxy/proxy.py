"""The prefill/decode proxy: each OpenAI completion or chat request goes first to a producer vLLM with
`max_tokens` 1 and `kv_transfer_params: {do_remote_decode: true}`, then, with the `kv_transfer_params` the
producer's answer carries (its instance and workers: services/engine/adapter/pd.py), to a consumer vLLM, whose
answer (streamed or not) is the client's. Producers and consumers are taken in turn.

A producer that fails (down, an error, an answer that is not a JSON object or carries no kv_transfer_params)
costs the request nothing but time: the consumer then computes the prompt itself (logged, counted in /healthz). A
consumer's error is the client's, as vLLM gave it; a consumer that cannot be reached is a 502.

The body is client input. Before anything reads it, `BodyGate` (shared/ops/http_gate.py) bounds it, as in front of the
controller: 401 without the bearer token when one is set (`auth_token`; /healthz stays open), 413 past
`max_body_bytes`, bodies over `large_body_bytes` read and handled `max_large_bodies` at a time with
`large_body_queue` more waiting unread (503 past that; a turn ends when the response starts, so a streamed answer
holds none), 422 naming the field nested deeper than `max_json_depth`. Then it must be a JSON object (400 naming
the problem otherwise); the proxy reads only `stream`, `max_tokens`, `max_completion_tokens`, `stream_options`,
`min_tokens` and `min_completion_tokens`, and forwards the rest as it came. Everything runs on uvicorn's one event
loop; one process serves one host:port, its bounds its own.
"""

from __future__ import annotations

import itertools
import json
import logging
import ssl
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.shared.ops.http_gate import BodyGate, BodySlots
from kvmesh.shared.options_cli import option
from kvmesh.shared.tls import client_context

log = logging.getLogger("kvmesh.pd_proxy")

FORWARDED_HEADERS = ("authorization",)  # passed to both vLLMs as the client sent them
OPEN_PATHS = frozenset({"/healthz"})  # open even with a token
MiB = 1 << 20


# Each setting's default is written once, on its field; its flag is generated from it (shared/options_cli.py).
@dataclass
class ProxyConfig:
    producers: list[str]  # base URLs, e.g. http://127.0.0.1:8100 (--prefill)
    consumers: list[str]  # (--decode)
    timeout_s: float = option("--timeout", "seconds one vLLM request may take", 600.0)
    max_body_bytes: int = option("--max-body-bytes", "largest request body accepted (413 past it)", 16 * MiB)
    max_connections: int = option("--max-connections", "open connections per vLLM", 256)
    large_body_bytes: int = option("--large-body-bytes", "a request body over this many bytes counts as large", MiB)
    max_large_bodies: int = option("--max-large-bodies", "large bodies read and handled at once (each until its "
                                   "response starts)", 2)
    large_body_queue: int = option("--large-body-queue", "large bodies that wait, unread, for a turn; one more gets "
                                   "503 with Retry-After", 32)
    max_json_depth: int = option("--max-json-depth", "JSON nested deeper than this is a 422 naming the field, "
                                 "before it is parsed", 128)
    auth_token: str | None = option("--auth-token", "require 'Authorization: Bearer <token>' on every endpoint "
                                    "but /healthz (or set $KVMESH_PD_PROXY_TOKEN); the header still goes on to the "
                                    "vLLMs", None)
    tls_ca: Path | None = option("--tls-ca", "CA file the https:// producer and consumer URLs are verified against, "
                                 "host names included (default: the system's CAs)", None, convert=Path)


@dataclass
class ProxyStats:
    requests: int = 0
    prefill_failures: int = 0  # the consumer computed the prompt itself
    decode_failures: int = 0
    by_consumer: dict[str, int] = field(default_factory=dict)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the producer gets: the request computing only the prompt, asking for its KV to be handed on."""
    prefill = dict(body)
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        prefill.pop(name, None)
    return prefill


def build_app(config: ProxyConfig) -> FastAPI:
    if not config.producers or not config.consumers:
        raise ValueError("pd-proxy needs at least one producer (--prefill) and one consumer (--decode)")
    stats = ProxyStats()
    producers = itertools.cycle(config.producers)
    consumers = itertools.cycle(config.consumers)
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
    clients: dict[str, httpx.AsyncClient] = {}
    verify: ssl.SSLContext | bool = client_context(config.tls_ca) if config.tls_ca is not None else True

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for url in {*config.producers, *config.consumers}:
            clients[url] = httpx.AsyncClient(base_url=url, timeout=config.timeout_s, limits=limits, verify=verify)
        try:
            yield
        finally:
            for client in clients.values():
                await client.aclose()

    app = FastAPI(title="kvmesh pd-proxy", lifespan=lifespan)
    app.add_middleware(BodyGate, token=config.auth_token, max_body=config.max_body_bytes,
                       large_body=config.large_body_bytes,
                       large_bodies=BodySlots(config.max_large_bodies, config.large_body_queue),
                       max_depth=config.max_json_depth, open_paths=OPEN_PATHS, max_body_hint="--max-body-bytes",
                       release_on_response=True)

    async def read_body(request: Request) -> dict[str, Any] | Response:
        """The body as a JSON object (the gate has bounded it), or the 400 naming what it is instead."""
        try:
            body = json.loads(await request.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error(400, f"the body is not JSON: {exc}")
        except RecursionError:  # (the gate refuses deeper nesting first, unless --max-json-depth is raised)
            return _error(400, "the body nests too deep for the JSON parser (--max-json-depth)")
        if not isinstance(body, dict):
            return _error(400, f"the body must be a JSON object, not {type(body).__name__}")
        return body

    async def prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """The producer's kv_transfer_params for `body`; None when it cannot give them (the consumer computes)."""
        url = next(producers)
        try:
            response = await clients[url].post(path, json=prefill_body(body), headers=headers)
            answer = response.json() if response.status_code == 200 else None
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if response.status_code != 200:
                reason = f"HTTP {response.status_code}: {response.text[:200]}"
            elif not isinstance(answer, dict):
                reason = f"its answer is a JSON {type(answer).__name__}, not an object"
            elif not isinstance(params, dict):
                reason = "its answer carries no kv_transfer_params (is it a kv_producer with enable_pd?)"
            else:
                return params
        except (httpx.HTTPError, ValueError, RecursionError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        stats.prefill_failures += 1
        log.warning("prefill at %s failed (%s): the consumer computes the prompt itself", url, reason)
        return None

    async def handle(path: str, request: Request) -> Response:
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        stats.requests += 1
        headers = {name: value for name, value in request.headers.items() if name.lower() in FORWARDED_HEADERS}
        headers["X-Request-Id"] = request.headers.get("x-request-id") or str(uuid.uuid4())
        params = await prefill(path, body, headers)
        decode = dict(body)
        if params is not None:
            decode["kv_transfer_params"] = params
        else:
            decode.pop("kv_transfer_params", None)
        url = next(consumers)
        stats.by_consumer[url] = stats.by_consumer.get(url, 0) + 1
        client = clients[url]
        if not body.get("stream"):
            try:
                response = await client.post(path, json=decode, headers=headers)
            except httpx.HTTPError as exc:
                stats.decode_failures += 1
                return _error(502, f"decode at {url} failed: {type(exc).__name__}: {exc}")
            return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))
        try:
            upstream = await client.send(client.build_request("POST", path, json=decode, headers=headers),
                                         stream=True)
        except httpx.HTTPError as exc:
            stats.decode_failures += 1
            return _error(502, f"decode at {url} failed: {type(exc).__name__}: {exc}")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for part in upstream.aiter_raw():
                    yield part
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "text/event-stream"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        url = config.consumers[0]
        try:
            response = await clients[url].get("/v1/models")
        except httpx.HTTPError as exc:
            return _error(502, f"{url}: {type(exc).__name__}: {exc}")
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "producers": config.producers, "consumers": config.consumers,
                "requests": stats.requests, "prefill_failures": stats.prefill_failures,
                "decode_failures": stats.decode_failures, "by_consumer": stats.by_consumer}

    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)
