"""NATS credentials for the services' command lines, the same flags for every store.

Flags (entry points add them with `add_nats_auth_flags`, read them with `nats_auth_from_args`):
    --nats-credentials FILE             a KVMesh credentials file (user, password, inbox prefix; shared/credentials.py)
    --nats-user U --nats-password P     user/password
    --nats-token T                      token
    --nats-nkey-seed FILE               nkey seed file (needs the `nkeys` package: pip install 'nats-py[nkeys]')
    --nats-creds-file FILE              a NATS .creds file (JWT and nkey; needs `nkeys` too)

Each credential also comes from an environment variable (KVMESH_NATS_CREDENTIALS, KVMESH_NATS_USER,
KVMESH_NATS_PASSWORD, KVMESH_NATS_TOKEN, KVMESH_NATS_NKEY_SEED, KVMESH_NATS_CREDS) so secrets need not show in
`ps` (pass a password by its variable or a file, never by its flag, on a shared host); a flag wins over its
variable. A server that rejects them makes `bus.connect` fail at once, saying so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping


from kvmesh.shared.bus import NatsAuth
from kvmesh.shared.errors import ConfigError

if TYPE_CHECKING:
    from kvmesh.shared.config import EngineConfig

ENV_VARS = {"user": "KVMESH_NATS_USER", "password": "KVMESH_NATS_PASSWORD", "token": "KVMESH_NATS_TOKEN",
            "nkey_seed": "KVMESH_NATS_NKEY_SEED", "creds_file": "KVMESH_NATS_CREDS"}
CREDENTIALS_ENV = "KVMESH_NATS_CREDENTIALS"


def add_nats_auth_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("NATS credentials (each also from $KVMESH_NATS_<NAME>)")
    group.add_argument("--nats-credentials",
                       help="a KVMesh credentials file (from `kvmesh credentials`; docs/security.md)")
    group.add_argument("--nats-user", help="user name (with --nats-password)")
    group.add_argument("--nats-password", help="password of --nats-user")
    group.add_argument("--nats-token", help="authorization token")
    group.add_argument("--nats-nkey-seed", help="path of an nkey seed file")
    group.add_argument("--nats-creds-file", help="path of a NATS .creds file (JWT)")


def nats_auth_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NatsAuth:
    """The credentials given by flags or environment; ConfigError naming the flag when they cannot work."""
    env = os.environ if environ is None else environ
    credentials = getattr(args, "nats_credentials", None) or env.get(CREDENTIALS_ENV)
    if credentials:
        return NatsAuth.from_file(credentials)
    values = {name: getattr(args, f"nats_{name}", None) or env.get(var) or None for name, var in ENV_VARS.items()}
    return checked(NatsAuth(**values), lambda name: "--nats-" + name.replace("_", "-"))


def checked(auth: NatsAuth, option: Callable[[str], str]) -> NatsAuth:
    """`auth` if it can work; ConfigError naming the option (`option(field name)`) when it cannot."""
    if auth.password and not auth.user:
        raise ConfigError(f"{option('password')} is set but {option('user')} is not")
    for name, file in (("nkey_seed", auth.nkey_seed), ("creds_file", auth.creds_file)):
        if file and not Path(file).is_file():
            raise ConfigError(f"{option(name)}: no file at {file}")
        if file and importlib.util.find_spec("nkeys") is None:
            raise ConfigError(f"{option(name)} needs the `nkeys` package: pip install 'nats-py[nkeys]'")
    return auth


def auth_from_config(config: "EngineConfig") -> NatsAuth | None:
    """The engine's NATS credentials from its config keys (nats_credentials, else nats_user / nats_password /
    nats_token / nats_nkey_seed / nats_creds_file); None when it names none."""
    if config.nats_credentials:
        try:
            return NatsAuth.from_file(config.nats_credentials)
        except ConfigError as exc:
            raise ConfigError(f"nats_credentials: {exc}") from None
    auth = NatsAuth(config.nats_user, config.nats_password, config.nats_token, config.nats_nkey_seed,
                    config.nats_creds_file)
    # checked first: a password without a user names no credentials, yet it is a mistake to report
    return checked(auth, lambda name: f"nats_{name}").or_none()
