"""End to end, P2P and prefill/decode (issue 27): two real vLLMs (CPU build) with the connector on one mesh that
has a controller and no store at all (`kvmesh up --no-disk --no-remote`), with `enable_pd` (which turns P2P on):
A is a kv_producer (it computes and stores), B a kv_consumer (it loads, stores nothing); each serves its CPU tier
to peers. `kvmesh pd-proxy` sends each request to A with max_tokens 1, then to B with A's kv_transfer_params.
vLLM "ref" (no connector) gives the reference outputs; vLLM's own prefix cache is off everywhere, so a warm
request's KV can only come from KVMesh.

Order: a P2P hit (B loads what A computed, found through the controller: B's retrieved count, A's served count);
PD through the proxy (one request, then 20 at once; no vLLM block left in use on either side); /move of a prefix
from A's CPU tier to B's; last, A frozen (SIGSTOP) while B loads from it, then killed: B serves by recompute, no
error to the client.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from support.e2e import ManagedProcess, MeshUp, VLLMServer, clean_env, free_port, kv_transfer_config, serving
from support.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256


def pd_yaml(path: Path, instance_id: str, nats_port: int) -> Path:
    path.write_text(yaml.safe_dump({
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25, "lmcache_instance_id": instance_id,
        "controller_url": f"localhost:{nats_port}", "enable_pd": True}))
    return path


@pytest.fixture(scope="module")
def p2p(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("p2p")
    # The controller keeps a silent producer listed for the module's whole run: a frozen A is still the peer B's
    # lookups name, however long a loaded machine takes to get B's request to its lookup.
    mesh = MeshUp(work / "mesh", extra_args=["--no-disk", "--no-remote", "--liveness-timeout", "3600"])

    def server(name: str, role: str) -> VLLMServer:
        config = pd_yaml(work / f"{name}.yaml", name, mesh.nats_port)
        return VLLMServer(f"vllm-{name}", demo_model, free_port(), work / f"{name}.log",
                          kv_config=kv_transfer_config(role), env=clean_env(LMCACHE_CONFIG_FILE=str(config)))

    servers = {"a": server("p2p-a", "kv_producer"), "b": server("p2p-b", "kv_consumer"),
               "ref": VLLMServer("vllm-p2p-ref", demo_model, free_port(), work / "ref.log")}
    proxy_port = free_port()
    proxy = ManagedProcess("pd-proxy", [sys.executable, "-m", "kvmesh.cli", "pd-proxy", "--prefill",
                                        servers["a"].url, "--decode", servers["b"].url, "--port", str(proxy_port)],
                           work / "pd-proxy.log", env=clean_env())
    mesh.start()
    try:
        mesh.wait_ready()
        with serving(servers):
            proxy.start()
            yield {**servers, "mesh": mesh, "proxy": f"http://127.0.0.1:{proxy_port}"}
    finally:
        proxy.stop()
        mesh.stop()


def _text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


def _counter(server: VLLMServer, name: str) -> float:
    return server.metrics().get(f"{name}_total", 0.0)


def _listed(mesh: MeshUp, tokens: list[int], instance: str) -> bool:
    layout = mesh.post("/lookup", {"tokens": tokens})["layout_info"]
    return instance in layout and layout[instance][1] >= len(tokens) - CHUNK


def _computed_by_a(p2p: dict[str, Any], prompt: str) -> tuple[str, list[int]]:
    """A computes `prompt` (its output equal to ref's) and the controller lists A for it: ref's output, the tokens."""
    a, ref, mesh = p2p["a"], p2p["ref"], p2p["mesh"]
    expected = _text(ref.complete(prompt, max_tokens=16))
    assert _text(a.complete(prompt, max_tokens=16)) == expected
    tokens = a.tokenize(prompt)
    wait_until(lambda: _listed(mesh, tokens, "p2p-a"), WAIT_S, interval=0.2, what="the controller to list A")
    return expected, tokens


def test_a_prompt_one_instance_computed_is_a_proven_load_from_its_cpu_tier_on_the_other(
        p2p: dict[str, Any], long_text: str) -> None:
    a, b, mesh = p2p["a"], p2p["b"], p2p["mesh"]
    prompt = f"[p2p hit]\n{long_text[:5000]}"
    expected, tokens = _computed_by_a(p2p, prompt)
    served_before = _counter(a, "lmcache:num_p2p_served_chunks")
    warm = b.complete(prompt, max_tokens=16)
    hit = b.assert_loaded(warm)  # B's worker loaded all it was promised, no load error
    assert hit.hit >= len(tokens) - CHUNK and _text(warm) == expected
    chunks = hit.hit // CHUNK
    wait_until(lambda: _counter(b, "lmcache:num_p2p_read_chunks") >= chunks, WAIT_S, interval=0.5,
               what="B's P2P reads counted")
    a.complete("A short request: an idle vLLM reports its connector's counters with its next step.", max_tokens=2)
    wait_until(lambda: _counter(a, "lmcache:num_p2p_served_chunks") - served_before >= chunks, WAIT_S,
               interval=0.5, what="A's served chunks counted")
    workers = mesh.post("/query_worker_info", {"instance_id": "all"})["worker_infos"]
    assert all(w["peer_init_url"] for w in workers if w["instance_id"] in ("p2p-a", "p2p-b")), workers


def _through_proxy(proxy: str, prompt: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{proxy}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def _blocks_in_use(server: VLLMServer) -> float:
    return server.metrics().get("vllm:kv_cache_usage_perc", -1.0)


def test_prefill_decode_through_the_proxy_loads_the_producers_kv_and_leaks_no_block(
        p2p: dict[str, Any], long_text: str) -> None:
    a, b, ref, proxy = p2p["a"], p2p["b"], p2p["ref"], p2p["proxy"]
    wait_until(lambda: _proxy_up(proxy), WAIT_S, interval=0.2, what="the pd-proxy")
    prompts = [f"[pd {i}]\n{long_text[1000 * i:1000 * i + 2500]}" for i in range(20)]
    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(lambda p: _text(ref.complete(p, max_tokens=16)), prompts))
    first = _through_proxy(proxy, prompts[0], b.model)
    hit = b.assert_loaded(first)  # the consumer loaded the prompt (all but the last token) from A
    assert hit.hit >= first["usage"]["prompt_tokens"] - 1 and _text(first) == expected[0]
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda p: _through_proxy(proxy, p, b.model), prompts[1:]))
    for answer, want in zip(answers, expected[1:]):
        assert b.assert_loaded(answer).hit >= answer["usage"]["prompt_tokens"] - 1 and _text(answer) == want
    health = httpx.get(f"{proxy}/healthz", timeout=10).json()
    assert health["requests"] == 20 and health["prefill_failures"] == 0 and health["decode_failures"] == 0
    for server in (a, b):  # no block held for a transfer once every request is done
        wait_until(lambda: _blocks_in_use(server) == 0.0, WAIT_S, interval=0.5,
                   what=f"{server.name}'s KV cache usage back to 0")


def _proxy_up(proxy: str) -> bool:
    try:
        return httpx.get(f"{proxy}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_move_of_a_prefix_from_one_instance_to_the_other(p2p: dict[str, Any], long_text: str) -> None:
    b, mesh = p2p["b"], p2p["mesh"]
    prompt = f"[p2p move]\n{long_text[6000:11000]}"
    expected, tokens = _computed_by_a(p2p, prompt)
    reads_before = _counter(b, "lmcache:num_p2p_read_chunks")
    moved = mesh.post("/move", {"old_position": ["p2p-a", "LocalCPUBackend"],
                                "new_position": ["p2p-b", "LocalCPUBackend"], "tokens": tokens, "should_copy": True})
    assert moved["num_tokens"] >= len(tokens) - CHUNK, moved
    wait_until(lambda: _listed(mesh, tokens, "p2p-b"), WAIT_S, interval=0.2, what="the controller to list B")
    warm = b.complete(prompt, max_tokens=16)
    assert b.assert_loaded(warm).hit >= len(tokens) - CHUNK and _text(warm) == expected
    # B's P2P reads are the move's (counted, reported with its next step), none the request's: its own CPU tier
    assert _counter(b, "lmcache:num_p2p_read_chunks") == reads_before + math.ceil(moved["num_tokens"] / CHUNK)


def _peer_lookups_named(mesh: MeshUp) -> float:
    """P2P lookups the controller answered with a peer (its /metrics)."""
    import httpx

    text = httpx.get(f"{mesh.controller}/metrics", timeout=10).text
    line = next(line for line in text.splitlines()
                if line.startswith('kvmesh_controller_peer_lookups_total{answer="peer"}'))
    return float(line.rsplit(" ", 1)[1])


def test_a_peer_that_freezes_and_dies_mid_load_costs_a_recompute_never_an_error(
        p2p: dict[str, Any], long_text: str) -> None:
    a, b, mesh = p2p["a"], p2p["b"], p2p["mesh"]
    prompt = f"[p2p peer dies]\n{long_text[12000:17000]}"
    expected, tokens = _computed_by_a(p2p, prompt)
    frozen = [a.pid, *a.descendants()]
    for pid in frozen:  # A still registered and listed, its peer stream open, and it answers nothing
        os.kill(pid, signal.SIGSTOP)
    try:
        failed_before = _counter(b, "lmcache:num_p2p_failed_reads")
        # The premise: B's lookup reaches the controller, which names A (listed however long A is silent, see
        # the fixture). A lookup the loaded controller answers too late names no one: B recomputes, stores
        # nothing (a consumer), and the next request asks again.
        for _ in range(3):
            named_before = _peer_lookups_named(mesh)
            lookups_failed_before = _counter(b, "lmcache:num_p2p_failed_lookups")
            answer = b.complete(prompt, max_tokens=16)  # B's lookup names A; its reads from A time out
            assert _text(answer) == expected
            named = _peer_lookups_named(mesh) > named_before
            if named and _counter(b, "lmcache:num_p2p_failed_lookups") == lookups_failed_before:
                break
        else:
            pytest.fail(f"B's P2P lookups never named A in 3 requests (the controller named a peer: {named}; B's "
                        f"failed lookups: {_counter(b, 'lmcache:num_p2p_failed_lookups')})")
        wait_until(lambda: _counter(b, "lmcache:num_p2p_failed_reads") > failed_before, WAIT_S, interval=0.5,
                   what="B's failed P2P reads counted")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
    a.stop()
    again = b.complete(prompt, max_tokens=16)  # the controller may still list A a moment: a miss, recomputed
    assert _text(again) == expected
