"""NATS credentials for the services: command-line flags, and a first connect that fails clearly.

Flags (entry points add them with `add_nats_auth_flags`):
    --nats-user U --nats-password P     user/password
    --nats-token T                      token
    --nats-nkey-seed FILE               nkey seed file (needs the `nkeys` package: pip install 'nats-py[nkeys]')

Each credential also comes from an environment variable (KVMESH_NATS_USER, KVMESH_NATS_PASSWORD,
KVMESH_NATS_TOKEN, KVMESH_NATS_NKEY_SEED) so secrets need not show in `ps`; a flag wins over its variable.

`connect_checked` exists because `bus.connect` reconnects forever, also when the very first connect is refused
for bad or missing credentials: a service would then hang silently. It first tries once without reconnecting,
turns "Authorization Violation" into an error that says so, waits (up to a limit) for a NATS that is not up
yet, and only then opens the long-lived, reconnecting connection.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import time
import urllib.parse
from pathlib import Path
from typing import Mapping

import nats
from nats.aio.client import Client as NatsClient

from kvmesh.shared import bus
from kvmesh.shared.bus import NatsAuth
from kvmesh.shared.errors import ConfigError, MeshUnavailable

log = logging.getLogger(__name__)

ENV_VARS = {"user": "KVMESH_NATS_USER", "password": "KVMESH_NATS_PASSWORD", "token": "KVMESH_NATS_TOKEN",
            "nkey_seed": "KVMESH_NATS_NKEY_SEED"}


def add_nats_auth_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("NATS credentials (each also from $KVMESH_NATS_<NAME>)")
    group.add_argument("--nats-user", help="user name (with --nats-password)")
    group.add_argument("--nats-password", help="password of --nats-user")
    group.add_argument("--nats-token", help="authorization token")
    group.add_argument("--nats-nkey-seed", help="path of an nkey seed file")


def nats_auth_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NatsAuth:
    """The credentials given by flags or environment; ConfigError naming the flag when they cannot work."""
    env = os.environ if environ is None else environ
    values = {name: getattr(args, f"nats_{name}", None) or env.get(var) or None for name, var in ENV_VARS.items()}
    if values["password"] and not values["user"]:
        raise ConfigError("--nats-password is set but --nats-user is not")
    seed = values["nkey_seed"]
    if seed:
        if not Path(seed).is_file():
            raise ConfigError(f"--nats-nkey-seed: no seed file at {seed}")
        if importlib.util.find_spec("nkeys") is None:
            raise ConfigError("--nats-nkey-seed needs the `nkeys` package: pip install 'nats-py[nkeys]'")
    return NatsAuth(**values)


def describe_auth(auth: NatsAuth | None) -> str:
    """Which kind of credentials, never their values (for error messages and logs)."""
    if auth is None:
        return "no credentials"
    kinds = [kind for kind, value in (("user/password", auth.user), ("token", auth.token),
                                      ("nkey seed", auth.nkey_seed)) if value]
    return " + ".join(kinds) or "no credentials"


async def connect_checked(url: str, name: str, auth: NatsAuth | None = None, wait_secs: float = 30.0) -> NatsClient:
    """A reconnecting NATS connection, once NATS has accepted `auth`.

    Raises MeshUnavailable at once when the server rejects the credentials, and after `wait_secs` when no
    server answers at all (a NATS still starting is waited for).
    """
    deadline = time.monotonic() + wait_secs
    while True:
        left = deadline - time.monotonic()
        # nats-py retries a refused port forever even without reconnects: look for a listening server first.
        if not await _any_listening(url, min(2.0, max(0.1, left))):
            if left <= 0:
                raise MeshUnavailable(f"no NATS server listening at {url} within {wait_secs:g}s (for {name})")
            await asyncio.sleep(min(0.5, max(0.0, left)))
            continue
        try:
            probe = await asyncio.wait_for(_probe(url, name, auth), max(1.0, min(10.0, left)))
            break
        except Exception as exc:
            text = str(exc).lower()
            if "authorization" in text or "authentication" in text:
                raise MeshUnavailable(f"NATS {url} rejected {name} ({describe_auth(auth)}): {exc}; pass the "
                                      "server's credentials (--nats-token, --nats-user/--nats-password or "
                                      "--nats-nkey-seed)") from None
            if time.monotonic() >= deadline:
                raise MeshUnavailable(f"NATS {url} did not accept a connection from {name} within {wait_secs:g}s: "
                                      f"{type(exc).__name__}: {exc}") from None
            log.info("%s: NATS %s not ready yet (%s); retrying", name, url, exc)
            await asyncio.sleep(0.5)
    await probe.close()
    return await asyncio.wait_for(bus.connect(url, name, auth), max(5.0, deadline - time.monotonic()))


async def _probe(url: str, name: str, auth: NatsAuth | None) -> NatsClient:
    """One connection attempt, no reconnects and no state-change logging (bus.connect would log its close
    as a disconnection). The credentials map to nats-py's options as in bus.connect."""
    auth = auth or NatsAuth()
    credentials: dict[str, str] = {}
    if auth.user:
        credentials.update(user=auth.user, password=auth.password or "")
    if auth.token:
        credentials["token"] = auth.token
    if auth.nkey_seed:
        credentials["nkeys_seed"] = auth.nkey_seed

    async def quiet(_: Exception) -> None:
        pass

    return await nats.connect(servers=[u.strip() for u in url.split(",")], name=f"{name} (credentials check)",
                              allow_reconnect=False, connect_timeout=2.0, error_cb=quiet, **credentials)


async def _any_listening(url: str, timeout: float) -> bool:
    for server in url.split(","):
        parsed = urllib.parse.urlsplit(bus.normalize_url(server))
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(parsed.hostname or "127.0.0.1",
                                                                       parsed.port or 4222), timeout)
        except (OSError, asyncio.TimeoutError):
            continue
        writer.close()
        return True
    return False
