"""The controller's REST API (FastAPI; served by uvicorn on the controller's event loop, see service.py).

LMCache's controller endpoints, all POST with JSON bodies: /lookup, /pin, /clear, /check_finish, /health,
/query_worker_info (instance_id "all": every instance), /query_instance, /move (within an instance, or between
two instances with enable_p2p over their peer streams); /compress and /decompress check their body and answer 501 naming what KVMesh lacks; ours in
addition: POST /unpin, POST /prefetch (/pin's body and answer: the held prefix starts moving from the
instance's lower tiers into its CPU tier; LMCache's coordinator has it as POST /cache/prefetches), GET /instances,
GET /usage (also at LMCache's coordinator paths GET /instances/usage and GET /instances/{instance_id}/usage; services/controller/usage.py), GET /metrics (Prometheus text),
GET /healthz (the REST server itself; always open), OpenAPI at /openapi.json and /docs.

Input rules: malformed bodies are 422 naming the field (a value nested deeper than MAX_JSON_DEPTH too, before
any JSON parser recurses into it), token lists longer than `max_tokens` are 413 (bodies too large to hold that
many are refused before they are read, and the stream is cut as soon as it passes the limit), a missing or wrong
bearer token is 401 when auth is on (checked before the body is read). Bodies over --large-body-bytes are read
--max-large-bodies at a time, --large-body-queue more wait unread, the rest get 503 with Retry-After (`BodySlots`,
shared/ops/http_gate.py):
each holds its parsed token list until answered, so this bounds the controller's memory. /lookup is the hot path: its body is checked by msgspec and its token list parsed by numpy
straight into the int64 array the hasher reads (see lookup_body.py), with the same rules as the schema the
OpenAPI document declares (~4x faster than FastAPI's json + pydantic for an 8k-token body here).

The package: schemas.py (the request and response bodies), lookup_body.py (the /lookup hot path), gate.py (the ASGI
gate), routes.py (the endpoints), metrics_page.py (/metrics), app.py (`create_app`, the entry point).
"""

from kvmesh.services.controller.api.app import create_app

__all__ = ["create_app"]
