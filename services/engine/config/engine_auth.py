"""The engine's NATS credentials, from its config keys (the stores and the controller take theirs as flags:
shared/messaging/nats_auth.py)."""

from __future__ import annotations

import dataclasses

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.bus import NatsAuth
from kvmesh.shared.messaging.nats_auth import checked


def auth_from_config(config: EngineConfig) -> NatsAuth | None:
    """The engine's NATS credentials from its config keys (nats_credentials, else nats_user / nats_password /
    nats_token / nats_nkey_seed / nats_creds_file; nats_auth_retry_secs; nats_tls_ca / nats_tls_cert /
    nats_tls_key); None when it names none."""
    tls = dict(tls_ca=config.nats_tls_ca, tls_cert=config.nats_tls_cert, tls_key=config.nats_tls_key)
    if config.nats_credentials:
        try:
            auth = NatsAuth.from_file(config.nats_credentials)
        except ConfigError as exc:
            raise ConfigError(f"nats_credentials: {exc}") from None
        auth = dataclasses.replace(auth, auth_retry_secs=config.nats_auth_retry_secs, **tls)
    else:
        auth = NatsAuth(config.nats_user, config.nats_password, config.nats_token, config.nats_nkey_seed,
                        config.nats_creds_file, auth_retry_secs=config.nats_auth_retry_secs, **tls)
    # checked first: a password without a user names no credentials, yet it is a mistake to report
    return checked(auth, lambda name: f"nats_{name}").or_none()


def engine_auth(config: EngineConfig) -> NatsAuth:
    """What an engine connects with: `auth_from_config`, else no credentials (a KVMesh-started NATS on this
    host provisions some: shared/messaging/credentials.py `credentials_for`), with its nats_auth_retry_secs either
    way."""
    return auth_from_config(config) or NatsAuth(auth_retry_secs=config.nats_auth_retry_secs,
                                                tls_ca=config.nats_tls_ca, tls_cert=config.nats_tls_cert,
                                                tls_key=config.nats_tls_key)
