"""A worker's engine registered in this process for the scheduler's lookup (`engine`, on support/engine_mesh.py's
`disk_mesh`, which a test module imports with it), and the set-up its tests share: the scheduler's lookup over it
(`scheduler_lookup`), what the worker saved written to its disk store (`wait_written_to_disk`), then held there
only (`only_on_disk`). Apart from support/engine_mesh.py because the scheduler's lookup imports vLLM, which the
other engine tests do not load."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents, StepEventLog
from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup, engines
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.tiers.base import StoreTier
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK
from kvmesh.shared.wire.keys import ChunkHasher

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


def scheduler_lookup() -> tuple[SchedulerLookup, ChunkHasher]:
    """The scheduler's lookup over the engines registered in this process (`engine`), and the key hasher it got
    from them."""
    lookup = SchedulerLookup(world_size=1, timeout=WAIT_S, nats_name="test-scheduler")
    hasher = lookup.hasher()
    assert hasher is not None
    return lookup, hasher


def wait_written_to_disk(worker: CacheEngine) -> StoreTier:
    """Wait until what `worker` saved is in its disk store's files (the write-behind sent it, the files are
    complete); the worker's client of that store."""
    assert worker.wait_write_behind(WAIT_S)
    client = worker.storage.lower(LOCAL_DISK)
    assert client is not None and worker.nats_loop is not None
    assert worker.nats_loop.call(client.wait_written(WAIT_S), WAIT_S + 1, default=False)
    return client


def only_on_disk(worker: CacheEngine, events: StepEventLog, lookup: SchedulerLookup) -> None:
    """What `worker` saved written to its disk store, then its CPU tier cleared and `lookup`'s mirror told so (as
    the next step's output would): the disk store alone holds those chunks."""
    wait_written_to_disk(worker)
    token_api.clear(worker, LOCAL_CPU)
    lookup.update(CpuTierEvents({0: events.take()}))
