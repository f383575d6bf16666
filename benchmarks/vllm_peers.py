"""Pieces the vLLM benchmarks share (ttft.py, serving.py): one vLLM OpenAI server per peer, its streaming reader,
the mesh (`kvmesh up`) and LMCache's multiprocess server, CPU pinning, free ports.

Pinning: vLLM's compute runs on core 0 (VLLM_CPU_OMP_THREADS_BIND=0 in the servers' environment); the client and
the side services (mesh, LMCache server) run on the other cores (`side_cores()`), so they do not steal the core
the forward runs on.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))

from demo import Child, wait_http  # noqa: E402

CHUNK = 256
KVMESH = {"kv_connector": "KVMeshConnector", "kv_connector_module_path": "kvmesh.services.engine.connector",
          "kv_role": "kv_both"}
LMCACHE_SITE = Path("/work/lmcache-site")  # where LMCache lives when installed outside the venv (pip --target)


@dataclass
class Completion:
    """One streaming completion as the client saw it."""

    ttft_s: float  # sent -> first token
    e2e_s: float  # sent -> last event
    text: str
    tokens: int  # generated tokens (the server's usage count)


class Server:
    """One vLLM OpenAI server for one peer."""

    def __init__(self, name: str, model: Path, port: int, log_dir: Path, max_len: int, args: list[str],
                 env: dict[str, str], batched_tokens: int | None = None) -> None:
        """`batched_tokens`: vLLM's --max-num-batched-tokens (default `max_len`: every prompt one prefill step)."""
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port",
                str(port), "--host", "127.0.0.1", "--max-model-len", str(max_len), "--max-num-batched-tokens",
                str(batched_tokens or max_len), *args]
        self.name = name
        self.model = str(model)
        self.url = f"http://127.0.0.1:{port}"
        self.child = Child(name, argv, log_dir / f"{name}.log", env=env)

    def ready(self) -> "Server":
        wait_http(self.child, f"{self.url}/v1/models", 900, self.name)
        return self

    def complete(self, prompt: list[int], max_tokens: int = 8) -> Completion:
        """One greedy streaming completion of exactly `max_tokens` tokens (EOS ignored)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        first = None
        pieces = []
        tokens = 0
        for event in completion_events(self.url, body, self.name):
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens") or tokens
            if not event.get("choices"):
                continue
            if first is None:
                first = time.perf_counter()
            pieces.append(event["choices"][0].get("text") or "")
        ended = time.perf_counter()
        return Completion((first or ended) - started, ended - started, "".join(pieces), tokens)

    def counters(self, prefixes: tuple[str, ...]) -> dict[str, float]:
        """vLLM's Prometheus counters (`*_total`) whose names start with one of `prefixes`, summed over labels."""
        return self._summed(prefixes, ("_total",))

    def histograms(self, prefixes: tuple[str, ...]) -> dict[str, tuple[float, float]]:
        """vLLM's Prometheus histograms whose names start with one of `prefixes`: {name: (sum, count)}, summed over
        labels (e.g. vllm:request_queue_time_seconds, and the connector's lmcache:time_to_lookup)."""
        summed = self._summed(prefixes, ("_sum", "_count"))
        names = {name.rsplit("_", 1)[0] for name in summed}
        return {name: (summed.get(f"{name}_sum", 0.0), summed.get(f"{name}_count", 0.0)) for name in names}

    def _summed(self, prefixes: tuple[str, ...], suffixes: tuple[str, ...]) -> dict[str, float]:
        import httpx

        totals: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=60).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if line.startswith("#") or not name.endswith(suffixes) or not name.startswith(prefixes):
                continue
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def stream(self, prompt: list[int], max_tokens: int = 8) -> tuple[float, str]:
        """(TTFT in seconds, generated text) of one greedy streaming completion."""
        done = self.complete(prompt, max_tokens)
        return done.ttft_s, done.text

    def stop(self) -> None:
        self.child.stop(60)


def completion_events(url: str, body: dict[str, Any], name: str = "vLLM") -> Iterator[dict[str, Any]]:
    """The server-sent events of one streaming `/v1/completions` request, decoded, as they arrive."""
    import httpx

    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{name}: HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                yield json.loads(line[5:])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pin_to(cores: set[int]) -> None:
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):
        pass


def side_cores() -> str:
    """The cores other than vLLM's compute core 0, as a taskset list (core 0 on a one-core machine)."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0) - {0})) or "0"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def lmcache_env(env: dict[str, str], site: Path | None = LMCACHE_SITE) -> tuple[dict[str, str] | None, str]:
    """`env` with LMCache importable (`site` prepended to PYTHONPATH when it exists), or None and the reason.

    The import is checked in a child with that environment, the way the LMCache server and its vLLM will see it.
    """
    out = dict(env)
    if site is not None and site.is_dir():
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    check = subprocess.run([sys.executable, "-c", "import lmcache.v1.multiprocess.server, importlib.metadata as m; "
                            "print(m.version('lmcache'))"], env=out, capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        last = (check.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"lmcache cannot be imported (looked in the venv and {site}): {last}"
    return out, check.stdout.strip()


def start_lmcache_server(work: Path, env: dict[str, str], l1_gb: float, chunk: int = CHUNK,
                         extra_args: list[str] | None = None) -> tuple[Child, int]:
    """LMCache's multiprocess server (CPU L1, LRU, chunks of `chunk` tokens) on the side cores, ready; (child,
    port). `extra_args` are appended to its command line (e.g. `--l2-adapter JSON`, an L2 behind the L1)."""
    port = free_port()
    child = Child("lmcache-server", ["taskset", "-c", side_cores(), sys.executable, "-m",
                                     "lmcache.v1.multiprocess.server", "--port", str(port), "--chunk-size",
                                     str(chunk), "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
                                     "--disable-observability", "--disable-metrics",
                                     "--supported-transfer-mode", "auto", *(extra_args or [])],
                  work / "logs" / "lmcache-server.log", env=env)
    deadline = time.monotonic() + 120
    while "cache server is running" not in child.log.read_text(errors="replace"):
        if not child.alive() or time.monotonic() > deadline:
            child.stop()
            raise RuntimeError(f"LMCache server did not start:\n{child.tail()}")
        time.sleep(0.5)
    return child, port


def lmcache_connector(port: int) -> dict[str, Any]:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.port": port}}


@dataclass
class Mesh:
    """A running `kvmesh up` (NATS, controller, disk store; a remote store only when started with `remote_gb`) on
    the side cores."""

    child: Child
    nats_port: int
    controller: str  # http://127.0.0.1:PORT
    disk_dir: Path

    def engine_yaml(self, path: Path, instance: str, cpu_gb: float, disk_gb: float, async_loading: bool,
                    chunk: int = CHUNK, remote_url: str | None = None) -> Path:
        """An LMCache-style config file for one vLLM's KVMeshConnector on this mesh; `remote_url` adds a remote tier
        (e.g. "lm://localhost:65432": the mesh's own remote store, reached over its NATS; or "redis://host:port")."""
        remote = f'remote_url: "{remote_url}"\n' if remote_url else ""
        path.write_text(remote +
            f"chunk_size: {chunk}\nlocal_cpu: true\nmax_local_cpu_size: {cpu_gb}\n"
            f'local_disk: "file://{self.disk_dir}"\nmax_local_disk_size: {disk_gb}\n'
            f'enable_controller: true\nlmcache_instance_id: "{instance}"\n'
            f'controller_url: "127.0.0.1:{self.nats_port}"\nenable_async_loading: {str(async_loading).lower()}\n')
        return path

    def stop(self) -> None:
        self.child.stop()


def start_mesh(work: Path, disk_gb: float, name: str = "kvmesh-up", remote_gb: float | None = None) -> Mesh:
    """`kvmesh up` on free ports: NATS, controller, a disk store of `disk_gb`, and a remote store of `remote_gb`
    (one partition) when given (none by default)."""
    remote = ["--no-remote"] if remote_gb is None else ["--remote-size", repr(remote_gb)]
    nats_port, controller_port = free_port(), free_port()
    disk_dir = work / f"{name}-disk"
    child = Child(name, ["taskset", "-c", side_cores(), sys.executable, "-m", "kvmesh.cli", "up",
                         "--nats-port", str(nats_port), "--port", str(controller_port), "--host", "127.0.0.1",
                         "--disk-dir", str(disk_dir), "--disk-size", str(disk_gb), *remote,
                         "--log-dir", str(work / "logs" / name)], work / "logs" / f"{name}.log")
    mesh = Mesh(child, nats_port, f"http://127.0.0.1:{controller_port}", disk_dir)
    try:
        wait_http(child, f"{mesh.controller}/healthz", 60, name)
    except BaseException:
        child.stop()
        raise
    return mesh
