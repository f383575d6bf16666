#!/usr/bin/env python
"""The KVMesh demo (`make demo`): the mesh, vLLM with KVMeshConnector, the query-twice of the disk-offload setup, the pin and clear quickstarts.

    python scripts/demo.py [--model DIR] [--workdir .demo] [--vllm-port 8000] [--controller-port 9000]

1. builds the tiny demo model into <workdir>/model unless --model is given (scripts/make_demo_model.py);
2. `kvmesh up`: NATS on --nats-port (9001, the quickstarts' controller_url / monitor port), the controller REST API on
   --controller-port (9000), a disk store and a remote store;
3. vLLM's OpenAI server on --vllm-port (8000) with KVMeshConnector and the quickstarts' example.yaml (CPU tier + the
   mesh's disk store), vLLM's own prefix cache off so the warm query measures KVMesh;
4. scripts/query_twice.py: the same long prompt twice, cold and warm TTFT;
5. the pin and clear quickstarts against the controller: completion, /tokenize, /pin, /lookup, /check_finish, /clear,
   /lookup (printed as the equivalent curl commands with their answers);
6. stops vLLM and the mesh (also on Ctrl-C or an error). Logs stay in <workdir>/logs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

SEED_PROMPT = "Explain the significance of KV cache in language models."
CONNECTOR = {"kv_connector": "KVMeshConnector", "kv_connector_module_path": "kvmesh.services.engine.connector",
             "kv_role": "kv_both"}


def example_yaml(nats_port: int, disk_dir: Path) -> str:
    return (
        "chunk_size: 256\n"
        "local_cpu: True\n"
        "max_local_cpu_size: 1\n"
        f'local_disk: "file://{disk_dir}"\n'
        "max_local_disk_size: 2\n"
        "# cache controller configurations\n"
        "enable_controller: True\n"
        'lmcache_instance_id: "lmcache_default_instance"\n'
        f'controller_url: "localhost:{nats_port}"\n'
        "lmcache_worker_port: 8001\n"
        'distributed_url: "localhost:8002"\n'
    )


class Child:
    """A child process in its own process group, output to a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        print(f"stopped {self.name} (exit {self.process.returncode})")


def wait_http(child: Child, url: str, timeout: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    last_dot = time.monotonic()
    while time.monotonic() < deadline:
        if not child.alive():
            raise SystemExit(f"{what} exited during start-up; its log ({child.log}):\n{child.tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                print()
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() - last_dot > 5:
            print(".", end="", flush=True)
            last_dot = time.monotonic()
        time.sleep(1)
    raise SystemExit(f"{what} not ready within {timeout:.0f}s; its log ({child.log}):\n{child.tail()}")


def show(method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """Do a curl-equivalent call and print it with the answer."""
    import httpx

    if body is None:
        print(f"$ curl {url}")
        response = httpx.get(url, timeout=60)
    else:
        print(f"$ curl -X POST {url} -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
        response = httpx.post(url, json=body, timeout=60)
    text = response.text if len(response.text) < 600 else response.text[:600] + " ..."
    print(f"  -> {response.status_code} {text}\n")
    response.raise_for_status()
    return response.json()


def seeds_000_001(vllm_url: str, controller: str, model: str) -> None:
    print("=== pin and clear quickstarts: pin, lookup, clear through the controller ===")
    show("POST", f"{vllm_url}/v1/completions", {"model": model, "prompt": SEED_PROMPT, "max_tokens": 10})
    tokens = show("POST", f"{vllm_url}/tokenize", {"model": model, "prompt": SEED_PROMPT})["tokens"]
    pin: dict[str, Any] = {}
    for _ in range(20):  # the chunk reaches the CPU tier right after the forward; the index a moment later
        pin = show("POST", f"{controller}/pin", {"tokens": tokens, "instance_id": "lmcache_default_instance",
                                                  "location": "LocalCPUBackend"})
        if pin.get("num_tokens") == len(tokens):
            break
        time.sleep(0.5)
    time.sleep(0.3)
    show("POST", f"{controller}/lookup", {"tokens": tokens})
    if pin.get("event_id"):
        show("POST", f"{controller}/check_finish", {"event_id": pin["event_id"]})
    show("POST", f"{controller}/clear", {"instance_id": "lmcache_default_instance", "location": "LocalCPUBackend"})
    time.sleep(0.5)
    show("POST", f"{controller}/lookup", {"tokens": tokens})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: build the demo model)")
    parser.add_argument("--workdir", type=Path, default=REPO / ".demo")
    parser.add_argument("--vllm-port", type=int, default=8000)
    parser.add_argument("--controller-port", type=int, default=9000)
    parser.add_argument("--nats-port", type=int, default=9001, help="NATS of the mesh (the quickstarts' controller_url)")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--context-file", type=Path, help="long text for query_twice (default: built in)")
    parser.add_argument("--dtype", help="vLLM --dtype (default: float32 for the demo model, else auto)")
    args = parser.parse_args(argv)
    work = args.workdir.resolve()
    logs = work / "logs"
    work.mkdir(parents=True, exist_ok=True)

    if args.model is None:
        from make_demo_model import ensure_model

        print(f"=== building the demo model into {work / 'model'} ===")
        model = ensure_model(work / "model", "tiny", max_positions=max(8192, args.max_model_len))
    else:
        model = args.model.resolve()
    dtype = args.dtype or ("auto" if args.model else "float32")
    (work / "example.yaml").write_text(example_yaml(args.nats_port, work / "disk"))

    children: list[Child] = []
    try:
        print(f"=== kvmesh up: NATS :{args.nats_port}, controller :{args.controller_port} ===")
        mesh = Child("kvmesh up", [sys.executable, "-m", "kvmesh.cli", "up", "--nats-port", str(args.nats_port),
                                   "--port", str(args.controller_port), "--disk-dir", str(work / "disk"),
                                   "--disk-size", "2", "--remote-size", "1", "--log-dir", str(logs)],
                     logs / "kvmesh-up.log")
        children.append(mesh)
        controller = f"http://localhost:{args.controller_port}"
        wait_http(mesh, f"{controller}/healthz", 60, "kvmesh up")

        print(f"=== vLLM with KVMeshConnector on :{args.vllm_port} (start-up takes a minute or two on CPU) ===")
        env = {**os.environ, "LMCACHE_CONFIG_FILE": str(work / "example.yaml"),
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--port", str(args.vllm_port), "--max-model-len", str(args.max_model_len), "--dtype", dtype,
                "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(CONNECTOR)]
        print("$ LMCACHE_CONFIG_FILE=example.yaml " + " ".join(argv[1:]))
        vllm = Child("vLLM", argv, logs / "vllm.log", env=env)
        children.append(vllm)
        vllm_url = f"http://localhost:{args.vllm_port}"
        wait_http(vllm, f"{vllm_url}/v1/models", 600, "vLLM")

        print("=== disk-offload setup: query twice ===")
        import query_twice

        qt_args = ["--base-url", f"{vllm_url}/v1", "--json", str(work / "query_twice.json"),
                   "--salt", f"demo {time.time():.0f}"]
        if args.context_file:
            qt_args += ["--context-file", str(args.context_file)]
        query_twice.main(qt_args)
        lines = [line for line in vllm.log.read_text(errors="replace").splitlines()
                 if "Reqid:" in line or "Storing KV cache" in line or "Retrieved" in line]
        print("connector log lines:\n  " + "\n  ".join(lines[-8:]) + "\n")

        seeds_000_001(vllm_url, controller, str(model))
        print(f"demo done; logs in {logs}")
        return 0
    finally:
        for child in reversed(children):
            child.stop()


if __name__ == "__main__":
    sys.exit(main())
