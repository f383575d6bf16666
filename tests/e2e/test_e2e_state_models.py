"""End to end on a model with recurrent state (real vLLM CPU servers): a tiny Qwen3-Next, three Gated DeltaNet
(linear attention) layers and one full-attention layer (vLLM: three MambaSpec groups and a FullAttentionSpec
group, hybrid KV cache manager on; adapter/kv_groups.py).

* "gdn": prefix caching on (vLLM's "align" mode keeps a state per block where a step ends) and 256-token steps,
  so a step ends at every chunk boundary: each chunk's recurrent state is stored beside it, and a hit ends where
  a state was saved. vLLM's own prefix cache is emptied before each warm request (POST /reset_prefix_cache,
  VLLM_SERVER_DEV_MODE=1), so the hits are KVMesh's: proven loads, output equal to "gdn-ref" (the same server
  without the connector).
* The same "gdn" server is on a mesh (`kvmesh up`: controller and disk store): after the controller's /clear of
  its CPU tier the disk store serves the chunks and states, and again after a restart of vLLM; the controller's
  /lookup of a state model ends where a state is held.
* "gdn-none": prefix caching off (vLLM keeps one running state per request, "none" mode): nothing to resume
  from, so vLLM must start and serve the model without the cache, after one WARNING naming the group, with its
  hybrid manager on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

import yaml

from support.e2e import (HMA_OFF, REFUSED, MeshUp, VLLMServer, check_state_model_hits, clean_env,
                         free_port, kv_transfer_config, serving)
from support.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256
YAML = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n"
INSTANCE = "gdn"
STATE_STEPS = ["--max-num-batched-tokens", "256"]  # a step ends at every chunk boundary: a state at each


def _text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


@pytest.fixture(scope="module")
def state_servers(tmp_path_factory: pytest.TempPathFactory, gdn_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("state-models")
    mesh = MeshUp(work / "mesh", extra_args=["--no-remote"])
    (work / "kvmesh.yaml").write_text(YAML)
    (work / "mesh.yaml").write_text(yaml.safe_dump({
        **yaml.safe_load(YAML), "lmcache_instance_id": INSTANCE,
        "controller_url": f"localhost:{mesh.nats_port}",
        "local_disk": str(work / "mesh" / "disk"), "max_local_disk_size": 1.0}))  # the mesh's disk store

    def server(name: str, cached: bool, *args: str, prefix_caching: bool = True,
               config: str = "kvmesh.yaml") -> VLLMServer:
        return VLLMServer(f"vllm-{name}", gdn_model, free_port(), work / f"{name}.log", dtype="bfloat16",
                          kv_config=kv_transfer_config() if cached else None,
                          env=clean_env(LMCACHE_CONFIG_FILE=str(work / config), VLLM_SERVER_DEV_MODE="1"),
                          prefix_caching=prefix_caching, extra_args=list(args))

    servers = {"gdn": server("gdn", True, *STATE_STEPS, config="mesh.yaml"),
               "gdn-ref": server("gdn-ref", False, *STATE_STEPS),
               "gdn-none": server("gdn-none", True, prefix_caching=False)}
    mesh.start()
    try:
        mesh.wait_ready()
        with serving(servers):
            yield {**servers, "mesh": mesh}
    finally:
        mesh.stop()


def test_a_linear_attention_hybrid_resumes_from_a_saved_state_with_identical_output(
        state_servers: dict[str, VLLMServer], long_text: str) -> None:
    check_state_model_hits(state_servers["gdn"], state_servers["gdn-ref"], long_text[20_000:24_000],
                           long_text[24_000:25_000], "gM1,M1,M1,F1")


def test_a_linear_attention_hybrid_without_states_starts_and_serves_without_the_cache(
        state_servers: dict[str, VLLMServer], long_text: str) -> None:
    server = state_servers["gdn-none"]
    prompt = long_text[20_000:24_000]
    first = server.complete(prompt, max_tokens=16)
    second = server.complete(prompt, max_tokens=16)
    assert _text(first) == _text(second) and first["usage"]["completion_tokens"] > 0
    log = server.log_text()
    warnings = [line for line in log.splitlines() if REFUSED in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "MambaSpec" in warnings[0], warnings
    assert str(server.model) in warnings[0] and "linear_attn" in warnings[0] and "'none'" in warnings[0]
    assert HMA_OFF not in log
    assert not server.hit_lines() and server.retrieved(second) == [] and server.stored_tokens(first) == 0


def test_a_linear_attention_hybrid_is_loaded_from_the_disk_store_after_a_clear_and_after_a_restart(
        state_servers: dict[str, Any], long_text: str) -> None:
    server: VLLMServer = state_servers["gdn"]
    mesh: MeshUp = state_servers["mesh"]
    prompt = long_text[30_000:34_000]
    expected = _text(state_servers["gdn-ref"].complete(prompt, max_tokens=16))
    tokens = server.tokenize(prompt)
    resumable = (len(tokens) - 1) // CHUNK * CHUNK  # a state after every chunk (256-token steps)
    assert resumable >= 3 * CHUNK, len(tokens)

    def listed(location: str) -> bool:
        """The controller's /lookup: the instance resumes from `location` at the last chunk end."""
        entry = mesh.post("/lookup", {"tokens": tokens})["layout_info"].get(INSTANCE)
        return entry is not None and tuple(entry) == (location, resumable)

    def states_loaded() -> float:
        return server.metrics().get("lmcache:num_retrieved_states_total", 0.0)

    def loaded_from_the_disk_store() -> None:
        server.reset_prefix_cache()
        before = states_loaded()
        warm = server.complete(prompt, max_tokens=16)
        assert server.assert_loaded(warm).hit == resumable  # every chunk and the state after the last
        assert _text(warm) == expected
        wait_until(lambda: states_loaded() == before + 1, WAIT_S, interval=0.5, what="the state's load counted")

    def states_stored() -> float:
        return server.metrics().get("lmcache:num_stored_states_total", 0.0)

    stored_before = states_stored()
    cold = server.complete(prompt, max_tokens=16)
    assert server.hit_for(cold).hit == 0 and _text(cold) == expected
    wait_until(lambda: states_stored() >= stored_before + resumable // CHUNK, WAIT_S, interval=0.5,
               what="a state stored after every chunk")
    wait_until(lambda: listed("LocalCPUBackend"), WAIT_S, interval=0.3, what="the prompt's states in the CPU tier")
    assert mesh.post("/clear", {"instance_id": INSTANCE, "location": "LocalCPUBackend"})["num_tokens"] >= resumable
    wait_until(lambda: listed("LocalDiskBackend"), WAIT_S, interval=0.3,
               what="the prompt's chunks and states in the disk store")
    loaded_from_the_disk_store()

    server.stop()
    server.start()
    server.wait_ready()
    loaded_from_the_disk_store()
