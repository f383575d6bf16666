"""Client and server code stay apart: loading vLLM's connector loads no store, controller or CLI code."""

from __future__ import annotations

import json
import subprocess
import sys

# Server-side modules: what a store or the controller runs, never the engine inside vLLM.
SERVER_MODULES = (
    "kvmesh.cli",
    "kvmesh.shared.store_service",
    "kvmesh.shared.chunk_index",
    "kvmesh.services.controller",
    "kvmesh.services.disk_store.store",
    "kvmesh.services.disk_store.service",
    "kvmesh.services.disk_store.writer",
    "kvmesh.services.disk_store.index",
    "kvmesh.services.disk_store.files",
    "kvmesh.services.remote_store.store",
    "kvmesh.services.remote_store.service",
    "kvmesh.services.remote_store.stream_server",
    "kvmesh.services.remote_store.buffers",
    "kvmesh.services.remote_store.persistence",
)

# Packages the engine imports nothing of: its tiers (services/engine/tiers/) are the stores' clients.
SERVER_PACKAGES = ("kvmesh.cli", "kvmesh.services.controller", "kvmesh.services.disk_store",
                   "kvmesh.services.remote_store")


def loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('kvmesh'))))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_the_engine_loads_no_server_code() -> None:
    """The connector (as vLLM imports it), the cache engine, its tiers, the worker agent and the embedded mesh load
    no module of a server package, nor the server-side modules of shared/."""
    loaded = loaded_after("import kvmesh.services.engine.connector, kvmesh.services.engine.core.cache_engine, "
                          "kvmesh.services.engine.tiers.build, kvmesh.services.engine.agents.worker_agent, "
                          "kvmesh.services.engine.mesh.embedded")
    assert "kvmesh.services.engine.tiers.remote_stream" in loaded  # the stores' clients, yes
    leaked = sorted(m for m in loaded if m.startswith(SERVER_MODULES)
                    or any(m == p or m.startswith(p + ".") for p in SERVER_PACKAGES))
    assert not leaked, f"the engine pulls in server code: {leaked}"
