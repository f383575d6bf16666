"""Sharing domains as stores and the controller see them: which domain each engine principal is in.

The administrator's domains file (domains.json beside the credentials, `kvmesh credentials --domain`;
shared/messaging/credentials.py writes it) maps each engine principal to its sharing domain; `DomainMap` is a store's or
the controller's view of it, re-read when it changes. An engine's own domain is in its credentials file
(`sharing_domain` (shared/messaging/credentials.py)).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import argparse

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.nats_auth import CREDENTIALS_ENV
from kvmesh.shared.options_cli import option

log = logging.getLogger(__name__)

DOMAINS_FILE = "domains.json"
DEFAULT_DOMAIN = "default"
_DOMAIN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_DOMAIN_LENGTH = 64


def check_domain_name(name: str) -> str:
    """`name` if it can name a sharing domain (1 to 64 of letters, digits, `_`, `-`: it also names a file);
    ValueError naming the problem otherwise."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_DOMAIN_LENGTH or not set(name) <= _DOMAIN_CHARS:
        raise ValueError(f"sharing domain {name!r}: expected 1 to {MAX_DOMAIN_LENGTH} letters, digits, '_' or '-'")
    return name


def read_domains(file: str | Path) -> dict[str, str]:
    """A domains map (principal user -> domain) from `file`; {} when it does not exist. ConfigError naming the
    file and the problem when it cannot be read or is not a JSON object of valid names."""
    path = Path(file)
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"domains file {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(entries, dict) or not all(isinstance(user, str) for user in entries):
        raise ConfigError(f"domains file {path}: expected a JSON object of principal -> domain")
    try:
        return {user: check_domain_name(domain) for user, domain in entries.items()}
    except ValueError as exc:
        raise ConfigError(f"domains file {path}: {exc}") from None


class DomainMap:
    """A store's view of which sharing domain each engine principal is in: the domains file (`read_domains`),
    re-read whenever its mtime or size changes, so `kvmesh credentials --domain` takes effect without a restart.
    No file (or `file` None): every caller is in the default domain. A file that turns bad keeps the last good
    map (logged once per change)."""

    def __init__(self, file: str | Path | None) -> None:
        self.file = None if file is None else Path(file)
        self._stamp: tuple[int, int] | None = None
        self._domains: dict[str, str] = {}
        if self.file is not None:
            self._domains = read_domains(self.file)  # a bad file at start: ConfigError, the store does not start
            self._stamp = self._current_stamp()

    def _current_stamp(self) -> tuple[int, int] | None:
        try:
            info = os.stat(self.file)  # type: ignore[arg-type]
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def _refresh(self) -> None:
        """Read the file again if its mtime or size changed."""
        if self.file is not None:
            stamp = self._current_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._domains = read_domains(self.file)
                except ConfigError as exc:
                    log.error("%s; keeping the sharing domains read before", exc)

    def engines(self) -> list[str]:
        """The engine principals (`engine.<instance token>`) the map lists, whatever their domain, sorted."""
        self._refresh()
        return sorted(user for user in self._domains if user.startswith("engine."))

    def names_other_domains(self) -> bool:
        """Whether the map puts any engine in a domain other than the default one."""
        self._refresh()
        return any(domain != DEFAULT_DOMAIN for domain in self._domains.values())

    def domain_of(self, caller: str) -> str:
        """The domain of the principal a caller path belongs to (`engine.<instance>[.<worker>]`); the default
        domain for any other caller (store, controller, operator) and any engine the map does not name."""
        self._refresh()
        if not self._domains or not caller.startswith("engine."):
            return DEFAULT_DOMAIN
        return self._domains.get(".".join(caller.split(".", 2)[:2]), DEFAULT_DOMAIN)


DOMAINS_FILE_ENV = "KVMESH_DOMAINS_FILE"


def domains_file_option(whose: str = "store") -> Any:
    """A store's or the controller's (`whose`) `domains_file` field, set by `--domains-file` (also
    $KVMESH_DOMAINS_FILE; shared/options_cli.py)."""
    return option("--domains-file", (
        "the sharing domains map (engine principal -> domain, `kvmesh credentials --domain`; re-read when it "
        f"changes; also ${DOMAINS_FILE_ENV}); default: domains.json beside the {whose}'s credentials file"),
        None, env=DOMAINS_FILE_ENV, convert=Path)


def domains_file_of(given: Path | None, args: "argparse.Namespace", environ: Mapping[str, str]) -> Path | None:
    """The domains file of a store or the controller: `given` (its --domains-file or $KVMESH_DOMAINS_FILE), else
    beside its credentials file (--nats-credentials / $KVMESH_NATS_CREDENTIALS), else None (`domains_map` then
    looks beside the credentials a KVMesh-started NATS on this host gives it)."""
    if given is not None:
        return given
    return domains_file_beside(getattr(args, "nats_credentials", None) or environ.get(CREDENTIALS_ENV))


def domains_file_beside(credentials: str | Path | None) -> Path | None:
    """Where a store or the controller finds the domains map: `domains.json` beside its own credentials file."""
    return None if credentials is None else Path(credentials).parent / DOMAINS_FILE
