"""End to end on models whose KV cache is not one plain full-attention group (real vLLM CPU servers).

* "hybrid" (Gemma2: sliding-window and full-attention layers): with our connector vLLM turns its hybrid KV
  cache manager off and keeps every layer's KV in one full-attention group, which is what chunks hold. A
  warm request must load (proven on the worker side) and answer exactly as a vLLM without a connector, which
  runs the same model with the hybrid manager on (two groups).
* "swa" (Mistral: every layer sliding-window): the one group drops blocks outside the window, so the connector
  must refuse the model: one WARNING at start naming it, then no lookup, load or store at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from support.e2e import VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm

pytestmark = pytest.mark.vllm

CHUNK = 256
YAML = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n"
REFUSED = "KVMesh loads and stores nothing for model"


def output_text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


@pytest.fixture(scope="module")
def model_servers(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path,
                  swa_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("models")
    (work / "kvmesh.yaml").write_text(YAML)
    env = clean_env(LMCACHE_CONFIG_FILE=str(work / "kvmesh.yaml"))
    servers = {
        "hybrid": VLLMServer("vllm-hybrid", hybrid_model, free_port(), work / "hybrid.log",
                             kv_config=kv_transfer_config(), env=env),
        "hybrid-ref": VLLMServer("vllm-hybrid-ref", hybrid_model, free_port(), work / "hybrid-ref.log"),
        "swa": VLLMServer("vllm-swa", swa_model, free_port(), work / "swa.log", kv_config=kv_transfer_config(),
                          env=env),
    }
    try:
        start_vllm(*servers.values())
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_mixed_sliding_window_model_hits_with_identical_output(model_servers: dict[str, VLLMServer],
                                                               long_text: str) -> None:
    server, ref = model_servers["hybrid"], model_servers["hybrid-ref"]
    prompt = long_text[:7_000]  # ~1.7k tokens: crosses the 128-token window many times
    expected = output_text(ref.complete(prompt, max_tokens=16))
    cold = server.complete(prompt, max_tokens=16)
    assert server.hit_for(cold).hit == 0 and output_text(cold) == expected
    warm = server.complete(prompt, max_tokens=16)
    assert server.assert_loaded(warm).hit >= cold["usage"]["prompt_tokens"] - CHUNK
    assert output_text(warm) == expected
    assert REFUSED not in server.log_text()


def test_all_sliding_window_model_is_refused_with_one_warning(model_servers: dict[str, VLLMServer],
                                                             long_text: str) -> None:
    server = model_servers["swa"]
    prompt = long_text[10_000:17_000]
    first = server.complete(prompt, max_tokens=16)
    second = server.complete(prompt, max_tokens=16)
    assert output_text(first) == output_text(second)
    log = server.log_text()
    warnings = [line for line in log.splitlines() if REFUSED in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "SlidingWindowSpec" in warnings[0], warnings
    assert str(server.model) in warnings[0]
    assert not server.hit_lines() and server.retrieved(second) == [] and server.stored_tokens(first) == 0
