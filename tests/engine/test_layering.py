"""Client and server code stay apart: loading vLLM's connector loads no store, controller or CLI code. Inside the
engine, imports run one way: no module imports from a floor above its own (services/engine/__init__.py), and
every engine folder's map names each of its modules."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Server-side packages, the engine imports nothing of: a store's or the controller's code, and the store kit they are
# built from (shared/store_kit/); the engine's tiers (services/engine/tiers/) are the stores' clients.
SERVER_PACKAGES = ("kvmesh.cli", "kvmesh.shared.store_kit", "kvmesh.services.controller", "kvmesh.services.disk_store",
                   "kvmesh.services.remote_store")


def loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('kvmesh'))))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_the_engine_loads_no_server_code() -> None:
    """The connector (as vLLM imports it), the cache engine, its tiers, the worker agent, the assembly and the
    embedded mesh load no module of a server package (the store kit of shared/ among them)."""
    loaded = loaded_after("import kvmesh.services.engine.connector, kvmesh.services.engine.core.cache_engine, "
                          "kvmesh.services.engine.tiers.registry, kvmesh.services.engine.agents.worker_agent, "
                          "kvmesh.services.engine.assembly, "
                          "kvmesh.services.engine.mesh.embedded")
    assert "kvmesh.services.engine.tiers.remote_stream" in loaded  # the stores' clients, yes
    leaked = sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in SERVER_PACKAGES))
    assert not leaked, f"the engine pulls in server code: {leaked}"


# ---- the engine's floors ------------------------------------------------------------------------------------------
ENGINE = Path(__file__).resolve().parents[2] / "services" / "engine"
ENGINE_PACKAGE = "kvmesh.services.engine"
# bottom to top, as services/engine/__init__.py maps them: a module imports from its own floor and those below
FLOORS = ("config", "mesh", "tiers", "core", "agents", "assembly", "adapter", "connector")


def floor_of(module: str) -> str:
    """The floor of an engine module (its folder, or the module itself at the engine's top)."""
    return module.removeprefix(ENGINE_PACKAGE + ".").split(".")[0]


def engine_modules() -> dict[str, Path]:
    return {".".join((ENGINE_PACKAGE, *path.relative_to(ENGINE).with_suffix("").parts)): path
            for path in sorted(ENGINE.rglob("*.py")) if path.name != "__init__.py"}


def engine_imports(path: Path) -> set[str]:
    """Every engine module or package `path` imports, at its top, in a function or under TYPE_CHECKING."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in imported if name.startswith(ENGINE_PACKAGE + ".")}


def test_every_engine_module_is_on_a_floor() -> None:
    modules = engine_modules()
    assert len(modules) > 40, "the engine's modules were not found"
    homeless = sorted(module for module in modules if floor_of(module) not in FLOORS)
    assert not homeless, f"engine modules on no floor (add them to FLOORS and services/engine/__init__.py): {homeless}"


def test_no_engine_import_runs_back_up() -> None:
    """Inside services/engine every import goes to the importer's own floor or one below it; and the tiers, handed
    what they need, import nothing of mesh/ either."""
    upward = []
    for module, path in engine_modules().items():
        floor = FLOORS.index(floor_of(module))
        for name in sorted(engine_imports(path)):
            target = floor_of(name)
            if target in FLOORS and FLOORS.index(target) > floor:
                upward.append(f"{module} imports {name} ({floor_of(module)} < {target})")
            if floor_of(module) == "tiers" and target == "mesh":
                upward.append(f"{module} imports {name} (a tier is handed what it needs)")
    assert not upward, "imports that run back up the engine's floors:\n" + "\n".join(upward)


def test_the_engine_map_lists_the_floors_in_order() -> None:
    doc = ast.get_docstring(ast.parse((ENGINE / "__init__.py").read_text()), clean=False) or ""
    listed = [match.group(1) for match in re.finditer(r"^    (\w+)(?:/|\.py)\s", doc, re.M)]
    assert tuple(listed) == FLOORS, f"services/engine/__init__.py maps the floors as {listed}, the test as {FLOORS}"


@pytest.mark.parametrize("folder", sorted(p.parent.relative_to(ENGINE).as_posix() or "."
                                          for p in ENGINE.rglob("__init__.py")))
def test_every_engine_module_is_on_its_folders_map(folder: str) -> None:
    """Each engine folder's `__init__.py` docstring names every module (and sub-folder) in it, and nothing else."""
    assert_folder_mapped(ENGINE / folder, f"services/engine/{folder}")


def assert_folder_mapped(directory: Path, name: str) -> None:
    """`directory`'s `__init__.py` docstring lists every module and sub-package in it (lines `    name.py ...`,
    `    name/ ...`), and nothing else."""
    doc = ast.get_docstring(ast.parse((directory / "__init__.py").read_text()), clean=False) or ""
    listed = set(re.findall(r"^    (\w+(?:\.py|/))\s", doc, re.M))
    present = {path.name for path in directory.glob("*.py") if path.name != "__init__.py"}
    present |= {f"{path.name}/" for path in directory.iterdir() if (path / "__init__.py").exists()}
    assert listed == present, (f"{name}/__init__.py: missing {sorted(present - listed)}, "
                               f"naming what is not there {sorted(listed - present)}")


# ---- shared/ -------------------------------------------------------------------------------------------------------
SHARED = ENGINE.parents[1] / "shared"
MAPPED_SHARED_FOLDERS = (".", "wire", "messaging", "store_kit", "ops")  # protocol/ and eviction/ map theirs in prose


def test_shared_imports_nothing_of_the_services() -> None:
    """shared/ is the floor under every service: none of its modules imports a service or the CLI, even for types."""
    upward = []
    for path in sorted(SHARED.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            upward += [f"{path.relative_to(SHARED)} imports {name}" for name in names
                       if name.startswith(("kvmesh.services", "kvmesh.cli"))]
    assert not upward, "shared/ imports a service:\n" + "\n".join(upward)


@pytest.mark.parametrize("folder", MAPPED_SHARED_FOLDERS)
def test_every_shared_module_is_on_its_folders_map(folder: str) -> None:
    """Each of these folders' `__init__.py` docstring names every module (and sub-folder) in it, and nothing else."""
    assert_folder_mapped(SHARED / folder, f"shared/{folder}")
