"""KVMesh: a KV-cache layer for vLLM on a NATS mesh.

Import names: `kvmesh.shared` (config, keys, protocol), `kvmesh.services.{engine,controller,disk_store,remote_store}`.
"""

__version__ = "0.1.0"
