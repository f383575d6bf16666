"""The command lines that start this host's stores, for whoever starts them: `kvmesh up` and the engine's
embedded mesh (services/engine/mesh/embedded.py). Config flows one way: the starter passes what it decides as
flags; every other setting is the store's own default (its options dataclass, services/*/options.py), and a
store reads no engine config. `--nats-url` and the credentials are added by LocalMesh (shared/ops/local_mesh.py).
"""

from __future__ import annotations

from pathlib import Path

from kvmesh.shared.ops.local_mesh import ServiceSpec
from kvmesh.shared.options_cli import GB
from kvmesh.shared.protocol import remote_store_id

DISK_STORE = "kvmesh.services.disk_store"
REMOTE_STORE = "kvmesh.services.remote_store"


def disk_store(root: Path, capacity_bytes: int, store_id: str, cache_policy: str) -> ServiceSpec:
    """A disk store of `capacity_bytes` on `root`."""
    return ServiceSpec(DISK_STORE, ["--dir", str(root), "--max-size-gb", repr(capacity_bytes / GB),
                                    "--store-id", store_id, "--cache-policy", cache_policy], store_id)


def remote_stores(capacity_bytes: int, num_partitions: int, cache_policy: str,
                  prefault_bytes: int = 0) -> list[ServiceSpec]:
    """Every partition of a remote store, each with `capacity_bytes` of memory of which `prefault_bytes` are
    faulted in at start."""
    specs = []
    for partition in range(num_partitions):
        store_id = remote_store_id(partition)
        args = ["--max-size-gb", repr(capacity_bytes / GB), "--partition", str(partition),
                "--partitions", str(num_partitions), "--store-id", store_id, "--cache-policy", cache_policy]
        if prefault_bytes:
            args += ["--prefault-gb", repr(prefault_bytes / GB)]
        specs.append(ServiceSpec(REMOTE_STORE, args, store_id,
                                 tls_flags=("remote-store", "--stream-tls-cert", "--stream-tls-key")))
    return specs
