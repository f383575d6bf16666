"""Shared test fixtures: the demo model (built once, cached), and processes that always get stopped.

* `demo_model`: the tiny Llama built by scripts/make_demo_model.py, cached across sessions under
  $KVMESH_TEST_CACHE (default ~/.cache/kvmesh-tests) and rebuilt only when its build arguments change.
* `long_text`: a long English text for prompts (the Python language reference).
* every process started through `e2e_support` (vLLM servers, `kvmesh up`) is stopped at the end of the session.
Helpers (free ports, process classes) live in tests/e2e_support.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from e2e_support import make_demo_model, model_cache_dir, stop_all


@pytest.fixture(scope="session", autouse=True)
def _stop_processes_at_exit() -> Iterator[None]:
    yield
    stop_all()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The tiny demo model (float32, 2 layers, vocab 4096), built once and reused across sessions."""
    return make_demo_model.ensure_model(model_cache_dir() / "models" / "tiny", "tiny")


@pytest.fixture(scope="session")
def long_text() -> str:
    return make_demo_model.long_text()
