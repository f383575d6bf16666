"""End to end on models whose KV cache is not one plain full-attention group (real vLLM CPU servers), with
vLLM's hybrid KV cache manager on (the connector implements SupportsHMA; adapter/kv_groups.py).

* "hybrid" (Gemma2: sliding-window and full-attention layers): two KV cache groups, each copied through its own
  block table. A warm request must load (proven on the worker side) and answer exactly as a vLLM without the
  connector; so must a longer prompt that extends it (a partial hit: the sliding-window group gets only the
  window before the hit).
* "swa" (Mistral: every layer sliding-window), prefilled in steps of 384 tokens (chunked prefill), so vLLM frees
  the blocks that left the window while the prompt is still being computed: the same proofs.
* Models with recurrent state (Qwen3-Next): test_e2e_state_models.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from support.e2e import VLLMServer, check_hits_with_identical_output, clean_env, free_port, kv_transfer_config, \
    serving

pytestmark = pytest.mark.vllm

CHUNK = 256
YAML = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n"
CHUNKED_PREFILL = ["--max-num-batched-tokens", "384"]


@pytest.fixture(scope="module")
def model_servers(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path,
                  swa_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("models")
    (work / "kvmesh.yaml").write_text(YAML)
    env = clean_env(LMCACHE_CONFIG_FILE=str(work / "kvmesh.yaml"))

    def server(name: str, model: Path, cached: bool, **kwargs: Any) -> VLLMServer:
        kwargs.setdefault("env", env)
        return VLLMServer(f"vllm-{name}", model, free_port(), work / f"{name}.log",
                          kv_config=kv_transfer_config() if cached else None, **kwargs)

    servers = {
        "hybrid": server("hybrid", hybrid_model, True),
        "hybrid-ref": server("hybrid-ref", hybrid_model, False),
        "swa": server("swa", swa_model, True, extra_args=CHUNKED_PREFILL),
        "swa-ref": server("swa-ref", swa_model, False, extra_args=CHUNKED_PREFILL),
    }
    with serving(servers):
        yield servers


def test_mixed_sliding_window_model_hits_with_identical_output(model_servers: dict[str, VLLMServer],
                                                               long_text: str) -> None:
    # ~1.7k tokens: crosses the 128-token window many times
    check_hits_with_identical_output(model_servers["hybrid"], model_servers["hybrid-ref"], long_text[:7_000],
                                     long_text[7_000:9_000])
    assert "KV cache groups gS2w128+0,F2" in model_servers["hybrid"].log_text()


def test_all_sliding_window_model_hits_with_identical_output_after_chunked_prefill(
        model_servers: dict[str, VLLMServer], long_text: str) -> None:
    server = model_servers["swa"]
    check_hits_with_identical_output(server, model_servers["swa-ref"], long_text[10_000:17_000],
                                     long_text[17_000:19_000])
    assert "KV cache groups gS2w128+0" in server.log_text()
