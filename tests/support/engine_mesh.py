"""Cache engines on a real NATS with a disk store process, for the engine tests (tests/engine/): `disk_mesh` (NATS
plus a disk store), `engine_on` (an engine connected to a URL) and `_store_and_settle` (a store that has reached
the disk). Nothing here imports vLLM (support/worker_engine.py does)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_DISK
from kvmesh.shared.wire.keys import KeyParams

from support.engine import PagedKV, disk_store_mesh, engine_config
from support.waiting import WAIT_S

PARAMS = KeyParams(model="test-model", kv_format="")


@pytest.fixture
def disk_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    with disk_store_mesh(tmp_path / "disk") as mesh:
        yield mesh


def engine_on(url: str, kv: PagedKV, **overrides: object) -> CacheEngine:
    engine = build_engine(engine_config(nats_url=url, **overrides), PARAMS, kv.layout)
    assert engine.wait_connected(WAIT_S), "engine did not reach NATS"
    return engine


def _store_and_settle(engine: CacheEngine, tokens: torch.Tensor, kv: PagedKV, slots: torch.Tensor) -> None:
    token_api.store(engine, tokens, **kv.kv(slots))
    assert engine.wait_write_behind(WAIT_S)
    client = engine.storage.lower(LOCAL_DISK)
    assert client is not None
    assert engine.nats_loop.call(client.wait_written(WAIT_S), WAIT_S + 2, default=False)
