"""POST /lookup, the controller's hot path: its body parsed into the int64 array the hasher reads, and answered.

msgspec checks the body is well-formed JSON and hands back `tokens` as raw bytes; when those are a plain list of
non-negative integer literals (what every client sends), numpy parses them straight into the int64 array the
hasher needs: ~3x faster than decoding 8k Python ints and packing them again. Anything else (floats, negatives,
strings, nesting...) takes the exact path, which either accepts it (1.0 counts as 1, as in JSON Schema) or names
the bad field in a 422. The rules are those of `LookupRequest` (schemas.py), which the OpenAPI document declares.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable

import msgspec
import numpy as np
from fastapi.responses import Response

from kvmesh.services.controller.api.schemas import MAX_CACHE_SALT, MAX_LORA_NAME, MAX_TOKEN_ID
from kvmesh.services.controller.core import ControllerCore
from kvmesh.services.controller.lookup import KeyRequest

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


def fast_tokens(body: bytes) -> tuple[np.ndarray, KeyRequest] | None:
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


def decode_lookup(body: bytes) -> tuple[np.ndarray | list[int], KeyRequest] | Response:
    """The token ids and key inputs of a /lookup body, or the 422 response saying which field is wrong."""
    fast = fast_tokens(body)
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
                return validation_error([{"type": "value_error", "loc": ["body", "tokens", index],
                                          "msg": f"Expected an integer token id in [0, {MAX_TOKEN_ID}], got {value!r}"}])
            value = int(value)
        lax_tokens.append(value)
    return lax_tokens, KeyRequest(lax.cache_salt, lax.lora_name)


def validation_error(errors: list[dict[str, Any]]) -> Response:
    """A 422 in FastAPI's shape: {"detail": [{"type", "loc", "msg"}, ...]}."""
    return Response(_ENCODER.encode({"detail": errors}), status_code=422, media_type="application/json")


def _msgspec_422(exc: Exception, kind: str) -> Response:
    """A msgspec error as FastAPI's 422 shape: {"detail": [{"type", "loc": ["body", field, index], "msg"}]}."""
    text = str(exc)
    message, _, where = text.partition(" - at `$")
    loc: list[str | int] = ["body"]
    for name, index in _MSGSPEC_PATH.findall(where.rstrip("`")):
        loc.append(name if name else int(index))
    return validation_error([{"type": kind, "loc": loc, "msg": message}])


LookupHandler = Callable[[bytes], tuple[int, bytes]]


def lookup_handler(core: ControllerCore) -> LookupHandler:
    """body -> (status, JSON bytes) for /lookup: one function for the hot path and the FastAPI route."""
    max_tokens = core.config.max_tokens

    def handle(body: bytes) -> tuple[int, bytes]:
        decoded = decode_lookup(body)
        if isinstance(decoded, Response):
            return decoded.status_code, bytes(decoded.body)
        tokens, key_request = decoded
        if len(tokens) > max_tokens:
            return 413, _ENCODER.encode({"detail": f"{len(tokens)} tokens exceed the limit of {max_tokens} "
                                                   "(--max-tokens)"})
        event_id, layout = core.lookup(tokens, key_request)
        return 200, _ENCODER.encode({"event_id": event_id, "layout_info": layout})

    return handle
