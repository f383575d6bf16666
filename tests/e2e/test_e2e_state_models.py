"""End to end on a model with recurrent state (real vLLM CPU servers): a tiny Qwen3-Next, three Gated DeltaNet
(linear attention) layers and one full-attention layer (vLLM: three MambaSpec groups and a FullAttentionSpec
group, hybrid KV cache manager on; adapter/kv_groups.py).

* "gdn": prefix caching on (vLLM's "align" mode keeps a state per block where a step ends) and 256-token steps,
  so a step ends at every chunk boundary: each chunk's recurrent state is stored beside it, and a hit ends where
  a state was saved. vLLM's own prefix cache is emptied before each warm request (POST /reset_prefix_cache,
  VLLM_SERVER_DEV_MODE=1), so the hits are KVMesh's: proven loads, output equal to "gdn-ref" (the same server
  without the connector).
* "gdn-none": prefix caching off (vLLM keeps one running state per request, "none" mode): nothing to resume
  from, so vLLM must start and serve the model without the cache, after one WARNING naming the group, with its
  hybrid manager on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from support.e2e import (HMA_OFF, REFUSED, VLLMServer, check_hits_with_identical_output, clean_env, free_port,
                         kv_transfer_config, serving)

pytestmark = pytest.mark.vllm

CHUNK = 256
YAML = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n"
STATE_STEPS = ["--max-num-batched-tokens", "256"]  # a step ends at every chunk boundary: a state at each


def _text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


@pytest.fixture(scope="module")
def state_servers(tmp_path_factory: pytest.TempPathFactory, gdn_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("state-models")
    (work / "kvmesh.yaml").write_text(YAML)
    env = clean_env(LMCACHE_CONFIG_FILE=str(work / "kvmesh.yaml"), VLLM_SERVER_DEV_MODE="1")

    def server(name: str, cached: bool, *args: str, prefix_caching: bool = True) -> VLLMServer:
        return VLLMServer(f"vllm-{name}", gdn_model, free_port(), work / f"{name}.log", dtype="bfloat16",
                          kv_config=kv_transfer_config() if cached else None, env=env,
                          prefix_caching=prefix_caching, extra_args=list(args))

    servers = {"gdn": server("gdn", True, *STATE_STEPS), "gdn-ref": server("gdn-ref", False, *STATE_STEPS),
               "gdn-none": server("gdn-none", True, prefix_caching=False)}
    with serving(servers):
        yield servers


def test_a_linear_attention_hybrid_resumes_from_a_saved_state_with_identical_output(
        state_servers: dict[str, VLLMServer], long_text: str) -> None:
    import httpx

    server = state_servers["gdn"]

    def empty_vllms_own_prefix_cache() -> None:
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()

    check_hits_with_identical_output(server, state_servers["gdn-ref"], long_text[20_000:24_000],
                                     long_text[24_000:25_000], empty_vllms_own_prefix_cache)
    hits = server.hit_lines()
    assert all(hit.hit % CHUNK == 0 for hit in hits), "a hit ends only where a state was saved (chunk ends)"
    assert "KV cache groups gM1,M1,M1,F1" in server.log_text()


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
