"""A worker's engine registered in this process for the scheduler's lookup (`engine`, on support/engine_mesh.py's
`disk_mesh`, which a test module imports with it). Apart from support/engine_mesh.py because the scheduler's
lookup imports vLLM, which the other engine tests do not load."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from kvmesh.services.engine.adapter.cpu_mirror import StepEventLog
from kvmesh.services.engine.adapter.scheduler_lookup import engines
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_DISK

from support.engine import PagedKV, engine_config
from support.engine_mesh import PARAMS
from support.waiting import WAIT_S, wait_until


@pytest.fixture
def engine(disk_mesh: LocalMesh, tmp_path: Path) -> Iterator[tuple[CacheEngine, PagedKV, StepEventLog]]:
    """A worker's engine registered in this process, reporting its CPU tier like the connector does."""
    kv = PagedKV(num_blocks=128)
    worker = build_engine(engine_config(nats_url=disk_mesh.nats_url, local_disk=str(tmp_path / "disk")), PARAMS,
                          kv.layout)
    events = StepEventLog()
    worker.cpu.listen(events)
    engines.add(0, worker)
    try:
        assert worker.wait_connected(WAIT_S)
        wait_until(lambda: worker.storage.lower(LOCAL_DISK), what="the disk store found")
        yield worker, kv, events
    finally:
        engines.remove(worker)
        worker.close()
