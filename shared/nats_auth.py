"""NATS credentials for the services' command lines, the same flags for every store.

Flags (entry points add them with `add_nats_auth_flags`, read them with `nats_auth_from_args`):
    --nats-user U --nats-password P     user/password
    --nats-token T                      token
    --nats-nkey-seed FILE               nkey seed file (needs the `nkeys` package: pip install 'nats-py[nkeys]')

Each credential also comes from an environment variable (KVMESH_NATS_USER, KVMESH_NATS_PASSWORD,
KVMESH_NATS_TOKEN, KVMESH_NATS_NKEY_SEED) so secrets need not show in `ps`; a flag wins over its variable.
A server that rejects them makes `bus.connect` fail at once, saying so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping


from kvmesh.shared.bus import NatsAuth
from kvmesh.shared.errors import ConfigError

if TYPE_CHECKING:
    from kvmesh.shared.config import EngineConfig

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


def auth_from_config(config: "EngineConfig") -> NatsAuth:
    """The engine's NATS credentials (its config keys nats_user / nats_password / nats_token / nats_nkey_seed)."""
    return NatsAuth(config.nats_user, config.nats_password, config.nats_token, config.nats_nkey_seed)
