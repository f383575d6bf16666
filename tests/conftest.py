"""Shared test fixtures: the demo model (built once, cached), and processes that always get stopped.

* `demo_model`: the tiny Llama built by scripts/make_demo_model.py, cached across sessions under
  $KVMESH_TEST_CACHE (default ~/.cache/kvmesh-tests) and rebuilt only when its build arguments change.
* `long_text`: a long English text for prompts (the Python language reference).
* `lora_adapters`: two seeded LoRA adapters of the demo model ("lora-a", "lora-b"), built offline and cached.
* `hybrid_model` / `swa_model`: sliding-window variants of the demo model (Gemma2 with sliding-window and full
  layers; Mistral with every layer windowed), built offline and cached.
* `gdn_model`: a tiny Qwen3-Next (Gated DeltaNet linear-attention layers and a full-attention layer, bf16), built
  offline and cached.
* `mamba2_model`: a tiny Nemotron-H (Mamba2, MLP and attention layers, fp32), built offline and cached.
* `eagle_draft`: an EAGLE-1 draft head for the demo model (one layer of its shape, random weights), built offline
  and cached.
* `vision_model`: an Idefics3 that takes images (a tiny vision tower in front of a demo-sized Llama, 64 tokens
  per image), with its processor and chat template, built offline and cached.
* `nats_mesh`: a KVMesh-started NATS with its credentials directory and no service processes (tests add their
  own principals and services).
* every process started through `support.e2e` (vLLM servers, `kvmesh up`) is stopped at the end of the session.
* on CPython 3.11 before 3.11.8, `ast.parse` runs with garbage collection held off (support/ast_parse_race.py).
Helpers (free ports, process classes) live in tests/support/e2e.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest

from support import ast_parse_race
from support.e2e import make_demo_model, make_lora_adapters, model_cache_dir, stop_all
from kvmesh.shared.ops.local_mesh import LocalMesh

ast_parse_race.install()


@pytest.fixture(scope="session", autouse=True)
def _stop_processes_at_exit() -> Iterator[None]:
    yield
    stop_all()


@pytest.fixture
def nats_mesh() -> Iterator[LocalMesh]:
    """A KVMesh-started NATS with no services (its credentials directory new, and removed after)."""
    local = LocalMesh([])
    local.start_nats()
    yield local
    local.stop()
    if local.credentials is not None:
        shutil.rmtree(local.credentials.root, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The tiny demo model (float32, 2 layers, vocab 4096), built once and reused across sessions."""
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "tiny", "tiny")


@pytest.fixture(scope="session")
def lora_adapters(demo_model: Path) -> dict[str, Path]:
    """name -> adapter directory; both change K and V of every layer, so their KV (and answers) differ."""
    return {name: make_lora_adapters.ensure_lora_adapter(model_cache_dir() / "lora" / name, demo_model, seed)
            for name, seed in (("lora-a", 1), ("lora-b", 2))}


@pytest.fixture(scope="session")
def hybrid_model() -> Path:
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "hybrid", "hybrid")


@pytest.fixture(scope="session")
def swa_model() -> Path:
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "swa", "swa")


@pytest.fixture(scope="session")
def gdn_model() -> Path:
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "qwen3next", "qwen3next")


@pytest.fixture(scope="session")
def mamba2_model() -> Path:
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "nemotronh", "nemotronh")


@pytest.fixture(scope="session")
def eagle_draft() -> Path:
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "eagle", "eagle")


@pytest.fixture(scope="session")
def vision_model() -> Path:
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "vision", "vision")


@pytest.fixture(scope="session")
def long_text() -> str:
    return make_demo_model.long_text()


@pytest.fixture
def nats_server() -> Iterator["EmbeddedNats"]:
    """A real nats-server on a free loopback port, stopped after the test."""
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats

    with EmbeddedNats() as server:
        yield server


@pytest.fixture
async def nc(nats_server: "EmbeddedNats") -> AsyncIterator[object]:
    """A NATS client on `nats_server` (imported here so GPU-only runs without nats-py can load this file)."""
    from kvmesh.shared.messaging import bus

    client = await bus.connect(nats_server.url, name="test")
    yield client
    await client.close()
