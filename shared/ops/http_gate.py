"""What a KVMesh HTTP server does to a request before its app sees it: `BodyGate`, a plain ASGI middleware in front
of the controller's REST API (services/controller/api/gate.py) and of `kvmesh pd-proxy` (services/pd_proxy/proxy.py).

Runs on the server's event loop. In order, for every HTTP request:
  * 401 without the bearer token, when one is configured (before the body is read); `open_paths` stay open;
  * 413 for a body over `max_body` bytes: by its Content-Length before it is read, or as soon as a body sent
    without one passes it;
  * a body over `large_body` bytes takes a turn (`BodySlots`): at most `slots` are read and served at once,
    `queue` more wait unread (the server stops reading their sockets: a few kB each), any more get 503 with
    Retry-After. A turn ends when the app returns, or, with `release_on_response`, as soon as its response starts
    (an app that no longer holds the body then, e.g. a proxy streaming the answer back);
  * 422 naming the top-level field whose value nests deeper than `max_depth` levels, before any JSON parser
    recurses into it (Python's and pydantic's do: a few thousand levels are a RecursionError);
then the app (or the subclass's `answer`) gets the body, read once and replayed.
Also here: `resolve_token`, the bearer token from a flag, a file or the environment, as both servers take it.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_ENCODER = msgspec.json.Encoder()
_JSON_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string (skipped whole) or a bracket
_OPEN = frozenset(b"[{")
_JSON_HEADER = (b"content-type", b"application/json")


def too_deep(body: bytes, max_depth: int, expected: str = "") -> dict[str, Any] | None:
    """FastAPI's 422 error item naming the top-level field whose value nests deeper than `max_depth`; None if
    none does (or the body is not JSON enough to say: its parser will)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return None  # (fewer brackets than the limit, strings included: cannot nest that deep)
    depth, key = 0, b""
    for match in _JSON_STRUCTURE.finditer(body):
        token = match.group()
        if token[0] == 0x22:  # '"'
            if depth == 1:
                key = token  # at the top level the last string before a bracket is that value's key
        elif token[0] in _OPEN:
            depth += 1
            if depth > max_depth:
                loc: list[str | int] = ["body"]
                if key:
                    try:
                        loc.append(str(json.loads(key)))
                    except ValueError:
                        loc.append(key[1:-1].decode(errors="replace"))
                return {"type": "value_error", "loc": loc,
                        "msg": f"nested deeper than {max_depth} levels" + (f" (expected {expected})" if expected
                                                                          else "")}
        else:
            depth -= 1
    return None


class BodySlots:
    """Large request bodies: at most `slots` read and served at once (each may hold a large parsed body until
    its turn ends), `queue` more waiting for a turn before they are read, any more refused."""

    def __init__(self, slots: int, queue: int) -> None:
        self._slots = asyncio.Semaphore(slots)
        self.queue = queue
        self.waiting = 0
        self.refused = 0

    async def enter(self) -> bool:
        """Take a slot (waiting in the queue if need be); False, at once, when the queue is full."""
        if self._slots.locked() and self.waiting >= self.queue:
            self.refused += 1
            return False
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        return True

    def leave(self) -> None:
        self._slots.release()


class BodyGate:
    """The checks above, in front of `app`. `max_body_hint` and `slots_hint` name the options in the 413 and 503
    answers; `expected_json` says in a 422 what a deep value should have been. A subclass answers some requests
    itself by overriding `answer`."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body: int, large_body: int, large_bodies: BodySlots,
                 max_depth: int, open_paths: frozenset[str] = frozenset(), max_body_hint: str = "",
                 slots_hint: str = "--max-large-bodies, --large-body-queue", expected_json: str = "",
                 release_on_response: bool = False) -> None:
        self.app = app
        self.expected = f"bearer {token}".encode() if token else None
        self.max_body = max_body
        self.large_body = large_body
        self.large_bodies = large_bodies
        self.max_depth = max_depth
        self.open_paths = open_paths
        self.max_body_hint = max_body_hint
        self.slots_hint = slots_hint
        self.expected_json = expected_json
        self.release_on_response = release_on_response

    async def answer(self, scope: Scope, body: bytes, send: Send) -> bool:
        """Answer the request here instead of the app (True when it did)."""
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length: int | None = None
        authorization = b""
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = int(value) if value.isdigit() else None
            elif name == b"authorization":
                authorization = value
        if self.expected is not None and scope["path"] not in self.open_paths:
            scheme, _, credentials = authorization.partition(b" ")
            if not hmac.compare_digest(scheme.lower() + b" " + credentials.strip(), self.expected):
                await send_json(send, 401, {"detail": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                                [(b"www-authenticate", b"Bearer")])
                return
        if length is not None and length > self.max_body:
            await send_json(send, 413, {"detail": f"request body of {length} bytes exceeds the limit of "
                                                  f"{self.max_body} bytes ({self.max_body_hint})"})
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        turn = _Turn(self.large_bodies)
        if length is not None and length > self.large_body and not await turn.take():
            await self._busy(send)
            return
        try:
            # Read the body here: to bound it while it streams, and to check it before any parser sees it.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body:
                    await send_json(send, 413, {"detail": f"request body exceeds the limit of {self.max_body} "
                                                          f"bytes ({self.max_body_hint})"})
                    return
                if size > self.large_body and not turn.held and not await turn.take():  # (no Content-Length)
                    await self._busy(send)
                    return
                chunks.append(chunk)
                more = message.get("more_body", False)
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            del chunks
            refused = too_deep(body, self.max_depth, self.expected_json)
            if refused is not None:
                await send_json(send, 422, {"detail": [refused]})
                return
            if await self.answer(scope, body, send):
                return
            replay = _Replay(body, receive)
            del body  # the replay holds it until the app has taken it
            await self.app(scope, replay, turn.ending_at_response(send) if self.release_on_response else send)
        finally:
            turn.end()

    async def _busy(self, send: Send) -> None:
        await send_json(send, 503, {"detail": f"too many large request bodies (over {self.large_body} bytes) at "
                                              f"once; retry shortly ({self.slots_hint})"},
                        [(b"retry-after", b"1")])


class _Turn:
    """One request's turn among the large bodies: taken at most once, ended at most once."""

    def __init__(self, slots: BodySlots) -> None:
        self.slots = slots
        self.held = False

    async def take(self) -> bool:
        self.held = await self.slots.enter()
        return self.held

    def end(self) -> None:
        if self.held:
            self.held = False
            self.slots.leave()

    def ending_at_response(self, send: Send) -> Send:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.end()
            await send(message)
        return sending


class _Replay:
    """The app's `receive`: the body once (then forgotten), then whatever the server sends (a disconnect)."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()


async def send_bytes(send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON_HEADER, (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


async def send_json(send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, status, _ENCODER.encode(body), headers)


def resolve_token(parser: argparse.ArgumentParser, token: str | None, token_file: Path | None, token_env: str,
                  token_file_env: str, notices: list[str], what: str = "the token") -> str | None:
    """The bearer token (`what`, in messages): `token` (a flag), `token_file` (a flag), $token_env,
    $token_file_env (the first given); a file that cannot be read or holds no token is a parser error naming it,
    one others may read a notice."""
    if token and token_file:
        parser.error("give --auth-token or --auth-token-file, not both")
    if token:
        return token
    path, source = token_file, "--auth-token-file"
    if path is None:
        if os.environ.get(token_env):
            return os.environ[token_env]
        if not os.environ.get(token_file_env):
            return None
        path, source = Path(os.environ[token_file_env]), f"${token_file_env}"
    try:
        text = path.read_text().strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"{source} {path}: cannot read {what} ({exc})")
    if not text or len(text.splitlines()) != 1 or any(c.isspace() for c in text):
        parser.error(f"{source} {path}: expected one line holding the token (no spaces), got "
                     f"{'an empty file' if not text else 'more'}")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        notices.append(f"{source} {path}: {what} file is open to other users (mode {mode & 0o777:o}); make it 0600")
    return text
