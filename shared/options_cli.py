"""Command-line flags generated from a service's options dataclass, so that each setting's default is written once:
on its field.

A field becomes a flag by being declared with `option(...)` (its default, flag name, help, unit, environment
variable); a field holding another options dataclass of flags is declared with `group(Class)`. Then:

    add_flags(parser, Options)           one argparse argument per flag, its default the field's in the flag's unit
    values(Options, args, environ)       the field values the parsed flags (else their variables) give, by field name
    to_args(options)                     the flags that start a service with these options (the inverse)

Checks that span several flags, and defaults computed from other settings (a store id from the host name), stay
in the service's own `options_from_args`, which builds the dataclass from `values`. Flags that are no field
(`--log-level`, the NATS credentials of shared/messaging/nats_auth.py) are added by the service as before.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Mapping, Sequence

GB = 1024**3  # the unit sizes are given in (flags scaled by it, the engine's *_size keys)

_FLAG = "kvmesh.flag"
_GROUP = "kvmesh.group"
DEFAULT = "{default}"  # in a help text: replaced by the flag's default (in the flag's unit)


@dataclass(frozen=True)
class Flag:
    """How one field is set on the command line."""

    name: str  # "--max-size-gb"
    help: str  # DEFAULT in it is replaced by the default, in the flag's unit
    scale: float = 1  # field value = round(flag value * scale): a scaled flag gives a count (GB -> bytes)
    type: Callable[[str], Any] | None = None  # argparse type; None: float when scaled, else the default's type
    choices: Sequence[Any] | None = None
    env: str | None = None  # the variable that gives the value when the flag is absent
    negated: bool = False  # a bool field that the flag turns off (--no-fsync); else a bool flag turns it on
    unset: bool = False  # argparse default None, so a later source can tell it was not given; then the field's
    written: bool = True  # whether `to_args` writes it (False: whoever starts the service adds it itself)
    convert: Callable[[Any], Any] | None = None  # flag value -> field value (after scaling), e.g. str -> Path

    @property
    def dest(self) -> str:
        """The argparse attribute, named after the flag as argparse names it."""
        return self.name.removeprefix("--").replace("-", "_")


def option(flag: str, help: str, default: Any = MISSING, **how: Any) -> Any:
    """A dataclass field set by `flag` (the rest of `how`: `Flag`'s fields); no default: the service must be
    given it, or computes it."""
    return dataclasses.field(default=default, metadata={_FLAG: Flag(flag, help, **how)})


def group(options: type) -> Any:
    """A dataclass field holding an `options` dataclass whose own fields are flags (defaults: `options()`)."""
    return dataclasses.field(default_factory=options, metadata={_GROUP: options})


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return None  # a field the service must be given (or computes): its flag's default is None


def _flag_value(flag: Flag, value: Any) -> Any:
    """A field value in the flag's unit."""
    return value / flag.scale if flag.scale != 1 and value is not None else value


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, options: type) -> None:
    """An argparse argument for every flag of `options` (its groups' included), in field order."""
    for f in dataclasses.fields(options):
        if _GROUP in f.metadata:
            add_flags(parser, f.metadata[_GROUP])
        if _FLAG not in f.metadata:
            continue
        flag: Flag = f.metadata[_FLAG]
        default = _flag_value(flag, _default(f))
        help_text = flag.help.replace(DEFAULT, _render(default))
        if isinstance(default, bool):
            parser.add_argument(flag.name, action="store_true", help=help_text)
            continue
        kind = flag.type or (float if flag.scale != 1 else type(default) if default is not None else str)
        parser.add_argument(flag.name, type=kind, choices=flag.choices, help=help_text,
                            default=None if flag.unset else default)


def values(options: type, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The value of every flagged field of `options` (by field name) that `args` give, else their variable in
    `environ`, else the field default (None where there is none); groups as their built dataclass."""
    env = environ or {}
    result: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        if _GROUP in f.metadata:
            result[f.name] = f.metadata[_GROUP](**values(f.metadata[_GROUP], args, environ))
        if _FLAG not in f.metadata:
            continue
        flag: Flag = f.metadata[_FLAG]
        raw = getattr(args, flag.dest)
        if isinstance(raw, bool):
            result[f.name] = raw != flag.negated
            continue
        if raw is None and flag.env and env.get(flag.env):
            raw = (flag.type or str)(env[flag.env])
        if raw is None:
            result[f.name] = _default(f)
            continue
        value = round(raw * flag.scale) if flag.scale != 1 else raw
        result[f.name] = flag.convert(value) if flag.convert else value
    return result


def to_args(options: Any) -> list[str]:
    """The flags that give `options` (flags with `written=False` and values None left out)."""
    args: list[str] = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if _GROUP in f.metadata:
            args += to_args(value)
        if _FLAG not in f.metadata:
            continue
        flag: Flag = f.metadata[_FLAG]
        if not flag.written or value is None:
            continue
        if isinstance(value, bool):
            if value != flag.negated:  # the value the flag gives (absent: the other one)
                args.append(flag.name)
            continue
        args += [flag.name, _written(_flag_value(flag, value))]
    return args


def _written(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _render(value: Any) -> str:
    """A default as a help text shows it: 6.0 as 6, 100000 as 100000."""
    return f"{value:g}" if isinstance(value, float) else str(value)
