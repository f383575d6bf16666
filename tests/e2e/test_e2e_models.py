"""End to end on models whose KV cache is not one plain full-attention group (real vLLM CPU servers), with
vLLM's hybrid KV cache manager on (the connector implements SupportsHMA; adapter/kv_groups.py).

* "hybrid" (Gemma2: sliding-window and full-attention layers): two KV cache groups, each copied through its own
  block table. A warm request must load (proven on the worker side) and answer exactly as a vLLM without the
  connector; so must a longer prompt that extends it (a partial hit: the sliding-window group gets only the
  window before the hit).
* "swa" (Mistral: every layer sliding-window), prefilled in steps of 384 tokens (chunked prefill), so vLLM frees
  the blocks that left the window while the prompt is still being computed: the same proofs.
* "gdn" (Qwen3-Next: Gated DeltaNet linear-attention layers and a full-attention layer): KVMesh does not cache
  recurrent (Mamba) state yet, so vLLM must start and serve it without the cache, after one WARNING naming
  the group, and keep its hybrid manager on.
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
HMA_OFF = "Turning off hybrid kv cache manager"
CHUNKED_PREFILL = ["--max-num-batched-tokens", "384"]


def output_text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


@pytest.fixture(scope="module")
def model_servers(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path, swa_model: Path,
                  gdn_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("models")
    (work / "kvmesh.yaml").write_text(YAML)
    env = clean_env(LMCACHE_CONFIG_FILE=str(work / "kvmesh.yaml"))

    def server(name: str, model: Path, cached: bool, **kwargs: Any) -> VLLMServer:
        return VLLMServer(f"vllm-{name}", model, free_port(), work / f"{name}.log",
                          kv_config=kv_transfer_config() if cached else None, env=env, **kwargs)

    servers = {
        "hybrid": server("hybrid", hybrid_model, True),
        "hybrid-ref": server("hybrid-ref", hybrid_model, False),
        "swa": server("swa", swa_model, True, extra_args=CHUNKED_PREFILL),
        "swa-ref": server("swa-ref", swa_model, False, extra_args=CHUNKED_PREFILL),
        "gdn": server("gdn", gdn_model, True, dtype="bfloat16"),
    }
    try:
        start_vllm(*servers.values())
        yield servers
    finally:
        for one in servers.values():
            one.stop()


def check_hits_with_identical_output(server: VLLMServer, ref: VLLMServer, prompt: str, extension: str) -> None:
    """Cold, warm (a proven load of all but the last token) and a longer prompt (a proven partial hit): each
    answer equals the reference's."""
    expected = output_text(ref.complete(prompt, max_tokens=16))
    cold = server.complete(prompt, max_tokens=16)
    assert server.hit_for(cold).hit == 0 and output_text(cold) == expected
    warm = server.complete(prompt, max_tokens=16)
    assert server.assert_loaded(warm).hit >= cold["usage"]["prompt_tokens"] - CHUNK
    assert output_text(warm) == expected
    longer = prompt + extension
    longer_expected = output_text(ref.complete(longer, max_tokens=16))
    extended = server.complete(longer, max_tokens=16)
    hit = server.assert_loaded(extended)
    assert hit.hit >= cold["usage"]["prompt_tokens"] - CHUNK and hit.hit < extended["usage"]["prompt_tokens"]
    assert output_text(extended) == longer_expected
    log = server.log_text()
    assert REFUSED not in log and HMA_OFF not in log


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


def test_a_linear_attention_hybrid_starts_and_serves_without_the_cache(model_servers: dict[str, VLLMServer],
                                                                       long_text: str) -> None:
    server = model_servers["gdn"]
    prompt = long_text[20_000:24_000]
    first = server.complete(prompt, max_tokens=16)
    second = server.complete(prompt, max_tokens=16)
    assert output_text(first) == output_text(second) and first["usage"]["completion_tokens"] > 0
    log = server.log_text()
    warnings = [line for line in log.splitlines() if REFUSED in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "MambaSpec" in warnings[0], warnings
    assert str(server.model) in warnings[0] and "linear_attn" in warnings[0]
    assert HMA_OFF not in log
    assert not server.hit_lines() and server.retrieved(second) == [] and server.stored_tokens(first) == 0
