"""The wire codec: a message is a frozen dataclass registered with `@message("tag")`, sent as the msgpack map
`{"v": PROTOCOL_VERSION, "t": tag, <fields>}`.

`decode(payload, Expected)` returns an `Expected` or raises `ProtocolError` (garbage, wrong version, wrong
tag, missing or mistyped field).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import msgpack

from kvmesh.shared.errors import ProtocolError

PROTOCOL_VERSION = 1

M = TypeVar("M")
_REGISTRY: dict[str, type] = {}
_TAGS: dict[type, str] = {}


def message(tag: str):
    """Class decorator: register a dataclass as a wire message under `tag`."""

    def register(cls: type[M]) -> type[M]:
        if tag in _REGISTRY:
            raise RuntimeError(f"duplicate message tag {tag!r}")
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return register


def encode(msg: Any) -> bytes:
    """A registered message as msgpack bytes."""
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered protocol message")
    body = _fields_of(msg)
    body["v"] = PROTOCOL_VERSION
    body["t"] = tag
    return msgpack.packb(body, use_bin_type=True)


def decode(payload: bytes, expected: type[M]) -> M:
    """Decode `payload` as an `expected` message, or raise ProtocolError saying what is wrong."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"{expected.__name__}: undecodable payload ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{expected.__name__}: payload is a {type(body).__name__}, not a map")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"{expected.__name__}: protocol version {body.get('v')!r}, expected {PROTOCOL_VERSION}")
    tag = _TAGS[expected]
    if body.get("t") != tag:
        raise ProtocolError(f"{expected.__name__}: message type {body.get('t')!r}, expected {tag!r}")
    return _from_fields(expected, body)


def _fields_of(msg: Any) -> dict[str, Any]:
    """A dataclass as a plain dict; nested dataclasses (e.g. ChunkMeta) become dicts too."""
    body: dict[str, Any] = {}
    for spec in _plan(type(msg)):
        value = getattr(msg, spec.name)
        body[spec.name] = _fields_of(value) if spec.nested is not None and value is not None else value
    return body


def _from_fields(cls: type[M], body: dict[str, Any]) -> M:
    kwargs: dict[str, Any] = {}
    for spec in _plan(cls):
        if spec.name in body:
            value = body[spec.name]
            if spec.nested is not None and isinstance(value, dict):
                value = _from_fields(spec.nested, value)
            elif not spec.conforms(value):
                raise ProtocolError(f"{cls.__name__}.{spec.name}: bad value of type {type(value).__name__}")
            kwargs[spec.name] = value
        elif spec.required:
            raise ProtocolError(f"{cls.__name__}: missing field {spec.name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a message's own checks (__post_init__)
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


@dataclass(frozen=True)
class _FieldPlan:
    """How one field of a message class is encoded and checked, worked out once per class (the hot path of
    every message, e.g. a stream get's reply, only runs these)."""

    name: str
    required: bool
    nested: type | None  # the dataclass inside the annotation (`X` or `X | None`), if any
    conforms: Callable[[Any], bool]  # the annotation's type check for a decoded msgpack value


_PLANS: dict[type, tuple[_FieldPlan, ...]] = {}


def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        plan = tuple(_FieldPlan(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                                _nested_dataclass(hints[f.name]), _checker(hints[f.name]))
                     for f in dataclasses.fields(cls))
        _PLANS[cls] = plan
    return plan


def _nested_dataclass(hint: Any) -> type | None:
    """The dataclass type inside `hint` (`X` or `X | None`), if any."""
    candidates = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for candidate in candidates:
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A shallow-but-useful type check of a decoded msgpack value against a field annotation."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda value: True
    if origin in (typing.Union, types.UnionType):
        options = tuple(_checker(arg) for arg in typing.get_args(hint))
        return lambda value: any(check(value) for check in options)
    if hint is type(None):
        return lambda value: value is None
    if hint is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _checker(item_hint)
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        key, val = _checker(key_hint), _checker(value_hint)
        return lambda value: isinstance(value, dict) and all(key(k) and val(v) for k, v in value.items())
    if isinstance(hint, type):
        return lambda value: isinstance(value, hint)
    return lambda value: True
