"""The one exception hierarchy of KVMesh. Messages name the key, subject, instance or file involved."""


class KVMeshError(Exception):
    """Base of every error KVMesh raises on purpose."""


class ConfigError(KVMeshError, ValueError):
    """A configuration key is unknown or has a bad value; the message names the key and where it came from."""


class ProtocolError(KVMeshError, ValueError):
    """A NATS message could not be decoded: garbage, a wrong version, a wrong type or a missing field."""


class StoreError(KVMeshError):
    """A chunk store refused or failed an operation (full, write error, unknown key, ...)."""


class MeshUnavailable(KVMeshError):
    """NATS or a service did not answer in time; callers fall back to running without the cache."""


class NoResponder(MeshUnavailable):
    """Nobody subscribes to a request's subject (NATS said so at once): the request was delivered to no one."""


class NatsServerError(KVMeshError):
    """The embedded nats-server could not be found or started."""
