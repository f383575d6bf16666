"""`create_app`: the controller's FastAPI app over one `ControllerCore`, behind the Gate."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.services.controller.api.gate import OPEN_PATHS, Gate
from kvmesh.services.controller.api.lookup_body import lookup_handler
from kvmesh.services.controller.api.routes import on_controller_error, on_http_error, router
from kvmesh.services.controller.core import ControllerCore
from kvmesh.services.controller.errors import ControllerError
from kvmesh.shared.ops.http_gate import BodySlots


def create_app(core: ControllerCore, lookup_fast_path: bool = True) -> FastAPI:
    """The FastAPI app over one ControllerCore, behind the Gate (auth, size limit; /lookup served there
    unless `lookup_fast_path` is False, then by its FastAPI route)."""
    config = core.config
    handle_lookup = lookup_handler(core)
    app = FastAPI(title="KVMesh controller", version="1",
                  description="LMCache-compatible KV cache controller: lookup, pin, unpin, clear, check_finish, "
                              "health and worker info over an index built from NATS events.")
    app.state.core = core
    app.state.handle_lookup = handle_lookup
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ControllerError, on_controller_error)  # type: ignore[arg-type]
    app.include_router(router)
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
