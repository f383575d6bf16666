"""The engine's sharing domain: which of its NATS credentials says it, and what it mixes into its chunk keys.

The administrator puts an engine principal in a domain with `kvmesh credentials --domain D`
(shared/messaging/credentials.py), which records the domain's name and its 32-byte secret in the engine's credentials
file. Stores enforce the domain from the caller's principal; the engine, for its part, mixes the domain into the root of
its chunk keys (`KeyParams.domain`) so that two domains never compute one key:

  * two honest tenants with the same prompt never meet at a store (no refused put, no miss on each other's chunk);
  * the key root takes a digest of the domain's *secret*, not only its public name, so an engine of another
    domain cannot compute this domain's keys at all: it can neither probe them (a refused put would say "held by
    another domain") nor occupy one first. Only the controller learns the root input (`RegisterEngine.domain`,
    which only it hears) so that /lookup hashes as the instance does.

The default domain mixes nothing: its keys are the same bytes as before domains existed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvmesh.services.engine.config.engine_auth import auth_from_config
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.shared import protocol
from kvmesh.shared.messaging.credentials import DEFAULT_DOMAIN, SharingDomain, local_credentials_file, sharing_domain

KEY_ROOT_PERSON = b"kvmesh-keyroot"  # blake2b personalisation of the secret's digest in the key root


def engine_credentials_file(config: EngineConfig, mesh_url: str | None) -> str | Path | None:
    """The KVMesh credentials file this engine connects with: `nats_credentials`, else (no other credentials given)
    the one a KVMesh-started NATS at `mesh_url` on this host provisioned for its principal; None otherwise."""
    if config.nats_credentials is not None:
        return config.nats_credentials
    if mesh_url and auth_from_config(config) is None:
        return local_credentials_file(mesh_url, protocol.Principal.engine(config.lmcache_instance_id).path)
    return None


def engine_domain(config: EngineConfig, mesh_url: str | None) -> SharingDomain:
    """The sharing domain the engine's credentials record (the default one without credentials); ConfigError
    naming the file when it cannot be read."""
    return sharing_domain(engine_credentials_file(config, mesh_url))


def key_domain(domain: SharingDomain) -> str:
    """What the domain mixes into the key root (`KeyParams.domain`): nothing for the default domain, else its name
    and, when the credentials carry one, a digest of its secret."""
    if domain.name == DEFAULT_DOMAIN:
        return DEFAULT_DOMAIN
    if domain.secret is None:
        return domain.name
    return f"{domain.name}/{hashlib.blake2b(domain.secret, digest_size=16, person=KEY_ROOT_PERSON).hexdigest()}"
