"""The gate in front of the controller's FastAPI app (plain ASGI): auth, body size, and the /lookup hot path."""

from __future__ import annotations

from starlette.types import ASGIApp, Scope, Send

from kvmesh.services.controller.api.lookup_body import LookupHandler
from kvmesh.shared.ops.http_gate import BodyGate, BodySlots, send_bytes

# Open even with auth on: the REST server's own health, and the API's documentation.
OPEN_PATHS = frozenset({"/healthz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
# JSON nested deeper than this is refused (422 naming the field) before a parser sees it: no endpoint takes more
# than 2 levels, and the parsers recurse (a few thousand levels made /lookup a 500 with RecursionError).
MAX_JSON_DEPTH = 32


class Gate(BodyGate):
    """The controller's `BodyGate` (shared/ops/http_gate.py: 401 without the token when one is configured, 413 past
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
