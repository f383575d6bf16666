"""End to end on a Mamba2 hybrid (real vLLM CPU servers): a tiny Nemotron-H, Mamba2 layers with an attention layer
and MLPs (vLLM: three MambaSpec groups and a FullAttentionSpec group, hybrid KV cache manager on;
adapter/kv_groups.py), the architecture of Nemotron-H and Granite 4.0-H.

Prefix caching on (vLLM's "align" mode keeps a Mamba2 state per block where a step ends) and 256-token steps:
vLLM's CPU Mamba2 path needs every prefill step within one block (fp32: 256-token blocks, the chunk size), and a
step then ends at every chunk boundary, so each chunk's state is stored beside it. vLLM's own prefix cache is
emptied before each warm request, so the hits are KVMesh's: proven loads, each resuming from a Mamba2 state, with
output equal to "mamba2-ref" (the same server without the connector).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from support.e2e import VLLMServer, check_state_model_hits, clean_env, free_port, kv_transfer_config, serving

pytestmark = pytest.mark.vllm

CHUNK = 256
STEPS = ["--max-num-batched-tokens", "256"]


@pytest.fixture(scope="module")
def mamba2_servers(tmp_path_factory: pytest.TempPathFactory, mamba2_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("mamba2-models")
    (work / "kvmesh.yaml").write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n")
    env = clean_env(LMCACHE_CONFIG_FILE=str(work / "kvmesh.yaml"), VLLM_SERVER_DEV_MODE="1")

    def server(name: str, cached: bool) -> VLLMServer:
        return VLLMServer(f"vllm-{name}", mamba2_model, free_port(), work / f"{name}.log", env=env,
                          kv_config=kv_transfer_config() if cached else None, prefix_caching=True, extra_args=STEPS)

    with serving({"mamba2": server("mamba2", True), "mamba2-ref": server("mamba2-ref", False)}) as servers:
        yield servers


def test_a_mamba2_hybrid_resumes_from_a_saved_state_with_identical_output(
        mamba2_servers: dict[str, VLLMServer], long_text: str) -> None:
    check_state_model_hits(mamba2_servers["mamba2"], mamba2_servers["mamba2-ref"], long_text[40_000:44_000],
                           long_text[44_000:45_000], "gM1,M1,M1,F1")
