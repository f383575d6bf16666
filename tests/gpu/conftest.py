"""GPU tests run on a bare CUDA box (torch + cupy + numpy, maybe no installed kvmesh, never vLLM).

If `kvmesh` is not installed, map its packages onto the repository folders as bare packages (no
`__init__` runs, so nothing beyond torch/cupy/numpy gets imported).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

try:
    import kvmesh.services.engine.core.paged_copy  # noqa: F401
except ImportError:
    for name, path in (
        ("kvmesh", ROOT / "kvmesh_pkg"),
        ("kvmesh.services", ROOT / "services"),
        ("kvmesh.services.engine", ROOT / "services" / "engine"),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
