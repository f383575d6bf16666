"""NATS credentials for the services' command lines, the same flags for every store.

Flags (entry points add them with `add_nats_auth_flags`, read them with `nats_auth_from_args`):
    --nats-credentials FILE             a KVMesh credentials file (user, password, inbox prefix; shared/messaging/credentials.py)
    --nats-user U --nats-password P     user/password
    --nats-token T                      token
    --nats-nkey-seed FILE               nkey seed file (needs the `nkeys` package: pip install 'nats-py[nkeys]')
    --nats-creds-file FILE              a NATS .creds file (JWT and nkey; needs `nkeys` too)
    --nats-auth-retry-secs S            how long a first connect retries credentials every server rejects
    --nats-tls-ca FILE                  verify the servers against this CA, and connect by TLS only
    --nats-tls-cert FILE --nats-tls-key FILE   a client certificate, for servers that ask for one

Each credential also comes from an environment variable (KVMESH_NATS_CREDENTIALS, KVMESH_NATS_USER,
KVMESH_NATS_PASSWORD, KVMESH_NATS_TOKEN, KVMESH_NATS_NKEY_SEED, KVMESH_NATS_CREDS, KVMESH_NATS_AUTH_RETRY_SECS,
KVMESH_NATS_TLS_CA, KVMESH_NATS_TLS_CERT, KVMESH_NATS_TLS_KEY) so
secrets need not show in `ps` (pass a password by its variable or a file, never by its flag, on a shared host); a
flag wins over its variable. A server that rejects them makes `bus.connect` fail once it has for
--nats-auth-retry-secs (a user just added may not be loaded yet), saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Callable, Mapping

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.bus import AUTH_RETRY_SECS, NatsAuth
from kvmesh.shared.tls import client_context

ENV_VARS = {"user": "KVMESH_NATS_USER", "password": "KVMESH_NATS_PASSWORD", "token": "KVMESH_NATS_TOKEN",
            "nkey_seed": "KVMESH_NATS_NKEY_SEED", "creds_file": "KVMESH_NATS_CREDS"}
CREDENTIALS_ENV = "KVMESH_NATS_CREDENTIALS"
AUTH_RETRY_ENV = "KVMESH_NATS_AUTH_RETRY_SECS"
TLS_ENV_VARS = {"tls_ca": "KVMESH_NATS_TLS_CA", "tls_cert": "KVMESH_NATS_TLS_CERT", "tls_key": "KVMESH_NATS_TLS_KEY"}


def add_nats_auth_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("NATS credentials (each also from $KVMESH_NATS_<NAME>)")
    group.add_argument("--nats-credentials",
                       help="a KVMesh credentials file (from `kvmesh credentials`; docs/security.md)")
    group.add_argument("--nats-user", help="user name (with --nats-password)")
    group.add_argument("--nats-password", help="password of --nats-user")
    group.add_argument("--nats-token", help="authorization token")
    group.add_argument("--nats-nkey-seed", help="path of an nkey seed file")
    group.add_argument("--nats-creds-file", help="path of a NATS .creds file (JWT)")
    group.add_argument("--nats-auth-retry-secs", type=float, help=(
        "how long the first connect retries credentials every server rejects: one just given them may not have "
        f"loaded them yet (default: {AUTH_RETRY_SECS:g})"))
    group.add_argument("--nats-tls-ca", help="CA file the NATS servers' certificates are verified against; the "
                                             "connection is then TLS or nothing (`kvmesh credentials --tls`)")
    group.add_argument("--nats-tls-cert", help="client certificate file, for a NATS that asks for one")
    group.add_argument("--nats-tls-key", help="key file of --nats-tls-cert (mode 0600)")


def nats_auth_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NatsAuth:
    """The credentials given by flags or environment; ConfigError naming the flag when they cannot work."""
    env = os.environ if environ is None else environ
    retry = auth_retry_from_args(args, env)
    credentials = getattr(args, "nats_credentials", None) or env.get(CREDENTIALS_ENV)
    tls = {name: getattr(args, f"nats_{name}", None) or env.get(var) or None for name, var in TLS_ENV_VARS.items()}
    flag = lambda name: "--nats-" + name.replace("_", "-")  # noqa: E731
    if credentials:
        return checked(dataclasses.replace(NatsAuth.from_file(credentials), auth_retry_secs=retry, **tls), flag)
    values = {name: getattr(args, f"nats_{name}", None) or env.get(var) or None for name, var in ENV_VARS.items()}
    return checked(NatsAuth(**values, auth_retry_secs=retry, **tls), flag)


def auth_retry_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> float:
    """--nats-auth-retry-secs, else $KVMESH_NATS_AUTH_RETRY_SECS, else the default; ConfigError naming the flag
    when it is not a number >= 0."""
    given = getattr(args, "nats_auth_retry_secs", None)
    text = env.get(AUTH_RETRY_ENV) if given is None else given
    if text is None or text == "":
        return AUTH_RETRY_SECS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"--nats-auth-retry-secs (or ${AUTH_RETRY_ENV}): expected a number of seconds >= 0, "
                          f"got {text!r}")
    return value


def checked(auth: NatsAuth, option: Callable[[str], str]) -> NatsAuth:
    """`auth` if it can work; ConfigError naming the option (`option(field name)`) when it cannot."""
    if auth.password and not auth.user:
        raise ConfigError(f"{option('password')} is set but {option('user')} is not")
    for name, file in (("nkey_seed", auth.nkey_seed), ("creds_file", auth.creds_file)):
        if file and not Path(file).is_file():
            raise ConfigError(f"{option(name)}: no file at {file}")
        if file and importlib.util.find_spec("nkeys") is None:
            raise ConfigError(f"{option(name)} needs the `nkeys` package: pip install 'nats-py[nkeys]'")
    if (auth.tls_cert or auth.tls_key) and not auth.tls_ca:
        raise ConfigError(f"{option('tls_cert')} / {option('tls_key')} need {option('tls_ca')}")
    if auth.tls_ca:
        try:
            client_context(auth.tls_ca, auth.tls_cert, auth.tls_key)
        except ConfigError as exc:
            raise ConfigError(f"{option('tls_ca')}: {exc}") from None
    return auth
