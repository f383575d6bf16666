"""End to end: a real vLLM (CPU build) serving the tiny demo model with KVMeshConnector, a real mesh.

What proves correctness: vLLM's own prefix cache is off (`--no-enable-prefix-caching`), so a warm request's
prefix KV can only come from KVMesh; every claimed hit is checked on the worker side too (`assert_loaded`:
each rank's "Retrieved N tokens" line says it loaded what the scheduler promised, and no load error was
reported, so a silent recompute fails the test); and the greedy output of the warm request must equal the
cold one AND the output of a vLLM started without any connector. The model is float32, so a full prefill and a prefill over
loaded KV agree to ~1e-6 and greedy decoding cannot flip on rounding (see scripts/make_demo_model.py).

Order and cost (2 cores; ~3 minutes with vLLM's compile cache warm, ~6 on a fresh machine):
  * the disk-offload setup (docs/compatibility.md) first: its own vLLM, started twice, with nothing else (the engine embeds NATS and a disk store in
    vLLM's process tree; no leftovers after vLLM exits);
  * then one module fixture starts together (start-ups overlap): `kvmesh up` (NATS, controller, disk store,
    remote store) on free ports; vLLM "a" (instance "lmcache_default_instance") and "b" ("instance_b") with the
    connector, the quickstarts' controller YAML, a CPU tier and the shared remote store; vLLM "ref" without connector
    (the reference outputs). "a" and "ref" also serve two LoRA adapters (`--max-loras 3`: one slot more than
    adapters, because vLLM CPU's torch LoRA ops index the slots with the "no LoRA" marker -1, so a base request
    batched with LoRA ones would get the last slot's adapter, vllm-project/vllm#48421). A tensor-parallel vLLM
    is started by its own test. The last test kills the mesh.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from kvmesh.services.engine.tiers.sealed import SEALED_MAGIC
from kvmesh.shared.wire import chunk_file

from support.e2e import MeshUp, VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm
from support.waiting import WAIT_S, wait_until
from support.processes import pid_alive, wait_dead

pytestmark = pytest.mark.vllm

CHUNK = 256
INSTANCE_A = "lmcache_default_instance"
INSTANCE_B = "instance_b"
SEED_PROMPT = "Explain the significance of KV cache in language models."


def controller_yaml(path: Path, instance_id: str, nats_port: int, **more: Any) -> Path:
    """The pin/clear quickstarts' YAML (controller_url = the controller's NATS), plus a shared remote store and
    `more` keys."""
    config = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.25,
        "enable_controller": True,
        "lmcache_instance_id": instance_id,
        "controller_url": f"localhost:{nats_port}",
        "lmcache_worker_port": 8001,
        "distributed_url": "localhost:8002",
        "remote_url": "lm://localhost:65432",
        **more,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def prompt_of(text: str, num_chars: int, salt: str) -> str:
    return f"[{salt}]\n{text[:num_chars]}"


def output_text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


# ---- the disk-offload setup: nothing but vLLM -------------------------------------------------------------------------------
SEED_002_YAML = """\
chunk_size: 256
local_cpu: false
max_local_cpu_size: 5.0
local_disk: "file://local/disk_test/local_disk/"
max_local_disk_size: 5.0
"""


def _mesh_children(server: VLLMServer) -> list[int]:
    """The nats-server and disk-store processes in vLLM's process tree."""
    found = []
    for pid in server.descendants():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "nats-server" in cmdline or "kvmesh.services.disk_store" in cmdline:
            found.append(pid)
    return found


def test_seed_002_embedded_disk_survives_restart(tmp_path: Path, demo_model: Path, long_text: str) -> None:
    (tmp_path / "disk-offload.yaml").write_text(SEED_002_YAML)
    env = clean_env(LMCACHE_CONFIG_FILE="disk-offload.yaml", LMCACHE_USE_EXPERIMENTAL="True")
    prompt = prompt_of(long_text[60_000:], 10_000, "disk")

    def serve(name: str) -> VLLMServer:
        server = VLLMServer(name, demo_model, free_port(), tmp_path / f"{name}.log", kv_config=kv_transfer_config(),
                            env=env, cwd=tmp_path)
        start_vllm(server)
        return server

    first = serve("vllm-disk-1")
    try:
        children = wait_until(lambda: _mesh_children(first) if len(_mesh_children(first)) >= 2 else None, WAIT_S,
                              interval=0.2, what="embedded nats-server and disk store")
        cold = first.complete(prompt, max_tokens=16)
        num_tokens = cold["usage"]["prompt_tokens"]
        assert first.hit_for(cold).hit == 0
        disk_dir = tmp_path / "local" / "disk_test" / "local_disk"

        def files_written() -> bool:  # the write-behind to disk is asynchronous
            return disk_dir.is_dir() and sum(1 for p in disk_dir.rglob("*") if p.is_file()) >= num_tokens // CHUNK

        wait_until(files_written, WAIT_S, interval=0.2, what=f"chunk files under {disk_dir}")
        for path in disk_dir.rglob(f"*{chunk_file.SUFFIX}"):  # sealed on the engine (encrypt_stores' default)
            _, offset = chunk_file.read_chunk_meta(path)
            assert path.read_bytes()[offset:offset + len(SEALED_MAGIC)] == SEALED_MAGIC, path
        warm = first.complete(prompt, max_tokens=16)
        assert first.assert_loaded(warm).hit >= num_tokens - CHUNK
        assert output_text(warm) == output_text(cold)
    finally:
        first.stop()
    for pid in children:
        assert wait_dead(pid), f"embedded mesh process {pid} outlived vLLM"

    second = serve("vllm-disk-2")
    try:
        again = second.complete(prompt, max_tokens=16)
        hit = second.assert_loaded(again)
        assert hit.hit >= num_tokens - CHUNK, hit  # the disk store rebuilt its index from the files
        assert output_text(again) == output_text(cold)
        children = _mesh_children(second)
    finally:
        second.stop()
    assert all(wait_dead(pid) for pid in children)
    assert not any(pid_alive(pid) for pid in children)


# ---- one mesh, two instances with the connector, one without ------------------------------------------------
def lora_args(adapters: dict[str, Path]) -> list[str]:
    return ["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(len(adapters) + 1), "--lora-modules",
            *(f"{name}={path}" for name, path in adapters.items())]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, demo_model: Path,
            lora_adapters: dict[str, Path]) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("e2e")
    mesh = MeshUp(work / "mesh")
    mesh.start()
    mesh.wait_ready()
    # a's CPU-tier hits are written layer by layer while vLLM's forward runs (on 2 cores its compute takes both,
    # so "auto" would not), each attention layer waiting for its own: the outputs below check that ordering
    a = VLLMServer("vllm-a", demo_model, free_port(), work / "vllm-a.log", kv_config=kv_transfer_config(),
                   env=clean_env(LMCACHE_CONFIG_FILE=str(controller_yaml(work / "a.yaml", INSTANCE_A, mesh.nats_port,
                                                                         cpu_load_pipeline="always"))),
                   extra_args=lora_args(lora_adapters))
    b = VLLMServer("vllm-b", demo_model, free_port(), work / "vllm-b.log", kv_config=kv_transfer_config(),
                   env=clean_env(LMCACHE_CONFIG_FILE=str(controller_yaml(work / "b.yaml", INSTANCE_B,
                                                                         mesh.nats_port))))
    ref = VLLMServer("vllm-ref", demo_model, free_port(), work / "vllm-ref.log", extra_args=lora_args(lora_adapters))
    try:
        start_vllm(a, b, ref)
        yield {"mesh": mesh, "a": a, "b": b, "ref": ref, "work": work}
    finally:
        for server in (ref, b, a):
            server.stop()
        mesh.stop()


def test_same_prompt_twice_is_served_from_the_cache(servers: dict[str, Any], long_text: str) -> None:
    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    prompt = prompt_of(long_text, 10_000, "twice")
    expected = ref.complete(prompt, max_tokens=16)
    num_tokens = expected["usage"]["prompt_tokens"]
    assert num_tokens > 4 * CHUNK, num_tokens

    started = time.perf_counter()
    cold = a.complete(prompt, max_tokens=16)
    cold_s = time.perf_counter() - started
    started = time.perf_counter()
    warm = a.complete(prompt, max_tokens=16)
    warm_s = time.perf_counter() - started

    cold_hit, warm_hit = a.hit_for(cold), a.assert_loaded(warm)
    assert cold_hit.hit == 0 and cold_hit.total == num_tokens
    assert a.stored_tokens(cold) == num_tokens  # every chunk, the partial last one too
    assert warm_hit.hit >= num_tokens - CHUNK, warm_hit
    assert warm_hit.load == num_tokens - 1  # vLLM computes the last token itself
    assert output_text(cold) == output_text(expected)
    assert output_text(warm) == output_text(expected)
    assert "in-step loads are written layer by layer during the forward" in a.log_text()  # the hit went that way
    print(f"prompt {num_tokens} tokens: cold {cold_s:.3f}s, warm {warm_s:.3f}s (end-to-end, 16 tokens)")


def test_engine_metrics_on_vllms_own_metrics_endpoint(servers: dict[str, Any], long_text: str) -> None:
    a: VLLMServer = servers["a"]
    before = a.metrics()
    prompt = prompt_of(long_text, 6_000, "metrics")
    cold = a.complete(prompt, max_tokens=4)
    warm = a.complete(prompt, max_tokens=4)
    warm_hit = a.assert_loaded(warm)
    stored = a.stored_tokens(cold)

    def counted() -> dict[str, float] | None:
        now = a.metrics()
        done = (now.get("lmcache:num_retrieved_tokens_total", 0) - before.get("lmcache:num_retrieved_tokens_total", 0)
                >= warm_hit.load and
                now.get("lmcache:num_stored_tokens_total", 0) - before.get("lmcache:num_stored_tokens_total", 0)
                >= stored)
        return now if done else None

    # the stats travel with vLLM's step outputs to the API server: they may land a moment after the reply
    after = wait_until(counted, WAIT_S, interval=0.5, what="the cold store and the warm load counted on /metrics")

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("lmcache:num_hit_tokens_total") == warm_hit.hit, "the logged hit, and the cold miss added nothing"
    assert delta("lmcache:num_lookup_requests_total") == 2
    assert delta("lmcache:num_retrieved_tokens_total") == warm_hit.load
    assert delta("lmcache:num_stored_tokens_total") == stored
    assert delta("lmcache:time_to_retrieve_count") >= 1 and delta("lmcache:time_to_store_count") >= 1
    assert delta("lmcache:time_to_lookup_count") == 2
    assert delta("lmcache:num_failed_retrieve_blocks_total") == 0
    assert after["lmcache:lmcache_is_healthy"] == 1 and after["lmcache:local_cache_usage"] > 0


def usage_of(mesh: MeshUp, instance_id: str) -> dict[str, dict[str, Any]]:
    """The controller's /usage of one instance: its modules by backend (location) name."""
    import httpx

    reply = httpx.get(f"{mesh.controller}/usage", params={"instance_id": instance_id}, timeout=30)
    reply.raise_for_status()
    [instance] = reply.json()["instances"]
    return {module["backend"]: module for module in instance["modules"]}


def test_usage_reports_the_instances_chunks_and_their_hits(servers: dict[str, Any], long_text: str) -> None:
    """The controller's /usage (issue 39) against a real vLLM: the CPU tier holds the prompt's chunks and counts the
    warm load's reads; the shared remote store the write-behind filled lists them too."""
    a: VLLMServer = servers["a"]
    mesh: MeshUp = servers["mesh"]

    def usage() -> dict[str, dict[str, Any]]:
        return usage_of(mesh, INSTANCE_A)

    before = wait_until(lambda: (u := usage()).get("LocalCPUBackend", {}).get("hits") is not None and u, WAIT_S,
                        interval=0.5, what="the instance's CPU-tier figures on /usage")
    prompt = prompt_of(long_text, 6_000, "usage")
    a.complete(prompt, max_tokens=4)
    loaded = a.assert_loaded(a.complete(prompt, max_tokens=4)).load
    chunks = -(-loaded // CHUNK)
    assert chunks >= 2, loaded

    def counted() -> dict[str, dict[str, Any]] | None:
        now = usage()
        cpu, remote = now.get("LocalCPUBackend"), now.get("RemoteBackend")
        new_hits = cpu["hits"] - before["LocalCPUBackend"]["hits"] if cpu and cpu["hits"] is not None else 0
        done = new_hits >= chunks and remote is not None and remote["num_chunks"] >= chunks
        return now if done else None

    after = wait_until(counted, WAIT_S, interval=0.5, what="the warm load's reads and the write-behind on /usage")
    cpu = after["LocalCPUBackend"]
    assert cpu["num_chunks"] >= chunks and cpu["reporting"] == cpu["producers"] >= 1
    assert 0 < cpu["used_bytes"] <= cpu["capacity_bytes"]
    assert after["RemoteBackend"]["shared"] is True


def test_a_prefetched_prompt_is_a_cpu_tier_hit(servers: dict[str, Any], long_text: str) -> None:
    """The controller's /prefetch (issue 39) against a real vLLM: A's prompt, cleared from A's CPU tier and held by
    the shared remote store, is warmed back into the CPU tier; the next request then loads it from there (its
    chunks are read out of the CPU tier, /usage's hits) with the output of a vLLM without the connector."""
    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    mesh: MeshUp = servers["mesh"]
    prompt = prompt_of(long_text[20_000:], 5_000, "prefetch")
    expected = output_text(ref.complete(prompt, max_tokens=16))
    assert output_text(a.complete(prompt, max_tokens=16)) == expected
    tokens = a.tokenize(prompt)
    full = len(tokens) // CHUNK * CHUNK
    assert full >= 2 * CHUNK, len(tokens)

    def held_at(location: str, instance_only: bool = True) -> bool:
        layout = mesh.post("/lookup", {"tokens": tokens})["layout_info"]
        entries = [layout.get(INSTANCE_A)] if instance_only else list(layout.values())
        return any(entry and entry[0] == location and entry[1] >= full for entry in entries)

    wait_until(lambda: held_at("RemoteBackend", instance_only=False), WAIT_S, interval=0.3,
               what="the remote store holding the prompt (write-behind)")
    mesh.post("/clear", {"instance_id": INSTANCE_A, "location": "LocalCPUBackend"})
    wait_until(lambda: not held_at("LocalCPUBackend"), WAIT_S, interval=0.3, what="A's CPU tier cleared")

    prefetch = mesh.post("/prefetch", {"instance_id": INSTANCE_A, "tokens": tokens})
    assert prefetch["event_id"] and prefetch["num_tokens"] >= full, prefetch
    wait_until(lambda: held_at("LocalCPUBackend"), WAIT_S, interval=0.3, what="the prefetch into A's CPU tier")

    def cpu_hits() -> int | None:  # None while a worker has not answered the controller
        return usage_of(mesh, INSTANCE_A)["LocalCPUBackend"]["hits"]

    [hits_before] = wait_until(lambda: (hits := cpu_hits()) is not None and [hits], WAIT_S, interval=0.5,
                               what="A's CPU-tier figures on /usage")
    warm = a.complete(prompt, max_tokens=16)
    hit = a.assert_loaded(warm)
    assert hit.hit >= full, hit
    assert output_text(warm) == expected
    loaded_chunks = -(-hit.load // CHUNK)
    wait_until(lambda: (cpu_hits() or 0) - hits_before >= loaded_chunks, WAIT_S, interval=0.5,
               what="the load's chunks read out of A's CPU tier")


def test_warm_chat_matches_reference(servers: dict[str, Any], long_text: str) -> None:
    """The disk-offload setup's request shape (chat, streaming): same text cold, warm and without a connector."""
    import httpx

    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    messages = [{"role": "user", "content": f"{long_text[20_000:28_000]}\n\nSummarize this in 2 sentences."}]

    def chat(server: VLLMServer) -> dict[str, Any]:
        body = {"model": server.model, "messages": messages, "max_tokens": 12, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()

    def content(completion: dict[str, Any]) -> str:
        return completion["choices"][0]["message"]["content"]

    expected = content(chat(ref))
    assert content(chat(a)) == expected
    warm = chat(a)
    assert content(warm) == expected
    hit = a.assert_loaded(warm)
    assert hit.hit >= hit.total - CHUNK


def test_seed_000_001_pin_lookup_clear(servers: dict[str, Any]) -> None:
    """Seeds 000 and 001 as written: completion, /tokenize, /pin, /lookup, /check_finish, /clear, /lookup.

    KVMesh pins hold until /unpin (LMCache's expire after 5 minutes); /unpin is checked on the way, then the
    prompt is pinned again, and /clear of the instance's CPU tier drops it, pinned or not.
    """
    a: VLLMServer = servers["a"]
    mesh: MeshUp = servers["mesh"]
    a.complete(SEED_PROMPT, max_tokens=10)
    tokens = a.tokenize(SEED_PROMPT)
    assert 0 < len(tokens) < CHUNK

    def pinned() -> dict[str, Any] | None:  # the store reaches the CPU tier right after the forward
        reply = mesh.post("/pin", {"tokens": tokens, "instance_id": INSTANCE_A, "location": "LocalCPUBackend"})
        return reply if reply["num_tokens"] == len(tokens) else None

    pin = wait_until(pinned, WAIT_S, interval=0.5, what="pin of the stored prompt")
    assert pin["event_id"]

    def pin_status() -> str | None:
        status = mesh.post("/check_finish", {"event_id": pin["event_id"]})["status"]
        return None if status == "pending" else status

    assert wait_until(pin_status, WAIT_S, interval=0.2, what="the pin event to finish") == "finished"

    def listed() -> dict[str, Any] | None:
        layout = mesh.post("/lookup", {"tokens": tokens})["layout_info"]
        entry = layout.get(INSTANCE_A)
        return layout if entry and list(entry) == ["LocalCPUBackend", len(tokens)] else None

    wait_until(listed, WAIT_S, interval=0.3, what=f"/lookup listing {INSTANCE_A}")

    unpin = mesh.post("/unpin", {"tokens": tokens, "instance_id": INSTANCE_A, "location": "LocalCPUBackend"})
    assert unpin["num_tokens"] == len(tokens)
    again = mesh.post("/pin", {"tokens": tokens, "instance_id": INSTANCE_A, "location": "LocalCPUBackend"})
    assert again["num_tokens"] == len(tokens)
    clear = mesh.post("/clear", {"instance_id": INSTANCE_A, "location": "LocalCPUBackend"})
    assert clear["event_id"] and clear["num_tokens"] >= len(tokens)

    def gone() -> bool:
        entry = mesh.post("/lookup", {"tokens": tokens})["layout_info"].get(INSTANCE_A)
        return not entry or entry[0] != "LocalCPUBackend"

    wait_until(gone, WAIT_S, interval=0.3, what=f"/lookup no longer listing {INSTANCE_A} on LocalCPUBackend")


def test_prefill_on_one_instance_is_a_hit_on_the_other(servers: dict[str, Any], long_text: str) -> None:
    """Two vLLM instances share the remote store: what A computed, B loads."""
    a: VLLMServer = servers["a"]
    b: VLLMServer = servers["b"]
    ref: VLLMServer = servers["ref"]
    prompt = prompt_of(long_text[40_000:], 9_000, "shared")
    expected = output_text(ref.complete(prompt, max_tokens=16))
    cold = a.complete(prompt, max_tokens=16)
    assert output_text(cold) == expected
    num_tokens = cold["usage"]["prompt_tokens"]

    def on_remote() -> bool:  # the write-behind to the remote store is asynchronous
        mesh: MeshUp = servers["mesh"]
        tokens = a.tokenize(prompt)
        layout = mesh.post("/lookup", {"tokens": tokens})["layout_info"]
        return any(entry[0] == "RemoteBackend" and entry[1] >= num_tokens - CHUNK for entry in layout.values())

    wait_until(on_remote, WAIT_S, interval=0.3, what="the remote store holding A's chunks")
    warm = b.complete(prompt, max_tokens=16)
    hit = b.assert_loaded(warm)
    assert hit.hit >= num_tokens - CHUNK, hit
    assert output_text(warm) == expected


def test_a_prompt_extending_an_earlier_one_loads_its_blocks_inside_the_last_chunk(servers: dict[str, Any],
                                                                                    long_text: str) -> None:
    """A chat's next turn: the prompt extends the last one, which ended inside a chunk. The whole blocks of that
    chunk the two share are loaded (a block-prefix hit, block_prefix.py), not recomputed."""
    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    ids = a.tokenize(prompt_of(long_text[60_000:], 6_000, "turns"))
    first = ids[: CHUNK + CHUNK // 2 + 50]  # ends 50 tokens past a block boundary of its second chunk
    second = ids[: len(first) + 200]
    assert len(second) > 2 * CHUNK, len(ids)
    a.complete(first, max_tokens=4)
    expected = output_text(ref.complete(second, max_tokens=16))
    warm = a.complete(second, max_tokens=16)
    hit = a.assert_loaded(warm)
    assert CHUNK < hit.hit <= len(first), hit  # beyond the whole chunks the two prompts share
    assert output_text(warm) == expected


def test_lora_adapters_never_share_kv(servers: dict[str, Any], long_text: str) -> None:
    """The same prompt with adapter a, then b (a miss: a's KV was computed under other K/V weights), then a
    again (a load); each answer is that of vLLM alone with the same adapter. /lookup finds the chunks only
    when told the adapter's name."""
    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    mesh: MeshUp = servers["mesh"]
    prompt = prompt_of(long_text[140_000:], 6_000, "lora")
    expected = {name: output_text(ref.complete(prompt, max_tokens=16, model=name)) for name in ("lora-a", "lora-b")}
    assert expected["lora-a"] != expected["lora-b"], "the adapters must change the answer for this test to mean much"

    first = a.complete(prompt, max_tokens=16, model="lora-a")
    assert a.hit_for(first).hit == 0 and output_text(first) == expected["lora-a"]
    num_tokens = first["usage"]["prompt_tokens"]
    tokens = a.tokenize(prompt)

    def listed(**fields: str) -> bool:
        entry = mesh.post("/lookup", {"tokens": tokens, **fields})["layout_info"].get(INSTANCE_A)
        return bool(entry) and entry[1] >= num_tokens - CHUNK

    wait_until(lambda: listed(lora_name="lora-a"), WAIT_S, interval=0.3, what="/lookup with lora_name lora-a")
    assert not listed() and not listed(lora_name="lora-b")

    other = a.complete(prompt, max_tokens=16, model="lora-b")
    assert a.hit_for(other).hit == 0, "adapter b never loads KV computed under adapter a"
    assert output_text(other) == expected["lora-b"]
    base = a.complete(prompt, max_tokens=16)
    assert a.hit_for(base).hit == 0, "nor does the base model"
    again = a.complete(prompt, max_tokens=16, model="lora-a")
    assert a.assert_loaded(again).hit >= num_tokens - CHUNK
    assert output_text(again) == expected["lora-a"]


def test_tensor_parallel_two_ranks_hit_on_both(servers: dict[str, Any], demo_model: Path, long_text: str,
                                               tmp_path: Path) -> None:
    """vLLM CPU with --tensor-parallel-size 2 (one core per rank), the connector's embedded default with a CPU
    tier: both ranks store their shard, the second request loads on both, the answer is vLLM's alone."""
    ref: VLLMServer = servers["ref"]
    (tmp_path / "tp.yaml").write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n")
    # auto-binding wants one NUMA node per rank; "0|1" gives each rank one core
    env = clean_env(LMCACHE_CONFIG_FILE=str(tmp_path / "tp.yaml"), VLLM_CPU_OMP_THREADS_BIND="0|1")
    tp = VLLMServer("vllm-tp2", demo_model, free_port(), tmp_path / "vllm-tp2.log", kv_config=kv_transfer_config(),
                    env=env, extra_args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    start_vllm(tp)
    try:
        prompt = prompt_of(long_text[160_000:], 6_000, "tp2")
        expected = output_text(ref.complete(prompt, max_tokens=16))
        cold = tp.complete(prompt, max_tokens=16)
        assert tp.hit_for(cold).hit == 0 and output_text(cold) == expected
        warm = tp.complete(prompt, max_tokens=16)
        hit = tp.assert_loaded(warm, ranks=2)
        assert hit.hit >= cold["usage"]["prompt_tokens"] - CHUNK
        assert output_text(warm) == expected
    finally:
        tp.stop()


def test_a_leased_prompt_outlives_eviction_pressure_and_load_tiers_are_obeyed(servers: dict[str, Any], demo_model: Path,
                                                                              tmp_path: Path) -> None:
    """Per-request retention and tiers (docs/connector.md): in a CPU tier of 16 chunks and no lower tier, a prompt
    stored with a lease (`kv_ttl`) keeps its chunks while unleased prompts stored after it push out the older
    unleased ones; asked again with `kv_load_tiers: ["LocalCPUBackend"]` (so a hit can only be a CPU-tier hit),
    the leased prompt loads every chunk and the unleased one stored right after it loads nothing. A request whose
    `kv_load_tiers` leave the CPU tier out is promised nothing from it and loads nothing. Outputs are vLLM's alone."""
    ref: VLLMServer = servers["ref"]
    # 5 chunks of 256 tokens at 2 KiB a token (the tiny model, fp32) are 2.5 MiB: 0.008 GB holds 16 such chunks
    (tmp_path / "small.yaml").write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.008\n")
    small = VLLMServer("vllm-small-cpu", demo_model, free_port(), tmp_path / "vllm-small-cpu.log",
                       kv_config=kv_transfer_config(), env=clean_env(LMCACHE_CONFIG_FILE=str(tmp_path / "small.yaml")))
    start_vllm(small)
    try:
        rng = random.Random("retention")
        prompts = [[rng.randrange(10, 4000) for _ in range(5 * CHUNK)] for _ in range(6)]
        leased, unleased, pressure = prompts[0], prompts[1], prompts[2:]
        expected = {i: output_text(ref.complete(p, max_tokens=8)) for i, p in enumerate(prompts[:2])}
        cold = small.complete(leased, max_tokens=8, kv_transfer_params={"kv_ttl": 3600, "kv_priority": 1})
        assert output_text(cold) == expected[0] and small.stored_tokens(cold) == 5 * CHUNK
        assert output_text(small.complete(unleased, max_tokens=8)) == expected[1]
        for prompt in pressure:  # 20 more chunks: every unleased chunk stored before these is pushed out
            small.complete(prompt, max_tokens=2)
        cpu_only = {"kv_load_tiers": ["LocalCPUBackend"]}

        not_from_cpu = small.complete(leased, max_tokens=8, kv_transfer_params={"kv_load_tiers": ["LocalDiskBackend"]})
        assert small.hit_for(not_from_cpu).hit == 0 and small.retrieved(not_from_cpu) == []
        assert output_text(not_from_cpu) == expected[0]

        warm = small.complete(leased, max_tokens=8, kv_transfer_params=cpu_only)
        hit = small.assert_loaded(warm)  # the worker's retrieved count, no load error
        assert hit.hit == 5 * CHUNK and hit.load == 5 * CHUNK - 1, hit
        assert output_text(warm) == expected[0]

        gone = small.complete(unleased, max_tokens=8, kv_transfer_params=cpu_only)
        assert small.hit_for(gone).hit == 0 and small.retrieved(gone) == []
        assert output_text(gone) == expected[1]
        assert "kv_transfer_params" not in small.kvmesh_warnings()  # every key was taken
    finally:
        small.stop()


def test_cache_salt_keeps_tenants_apart(servers: dict[str, Any], long_text: str) -> None:
    """vLLM's per-tenant `cache_salt`: the same prompt with salt s1, then s2 (a miss), then s1 again (a load);
    the controller's /lookup finds the chunks only when told the salt."""
    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    mesh: MeshUp = servers["mesh"]
    prompt = prompt_of(long_text[100_000:], 6_000, "salted")
    expected = output_text(ref.complete(prompt, max_tokens=16, cache_salt="s1"))
    first = a.complete(prompt, max_tokens=16, cache_salt="s1")
    assert a.hit_for(first).hit == 0 and output_text(first) == expected
    num_tokens = first["usage"]["prompt_tokens"]
    tokens = a.tokenize(prompt)

    def listed(**fields: str) -> bool:
        entry = mesh.post("/lookup", {"tokens": tokens, **fields})["layout_info"].get(INSTANCE_A)
        return bool(entry) and entry[1] >= num_tokens - CHUNK

    wait_until(lambda: listed(cache_salt="s1"), WAIT_S, interval=0.3, what="/lookup with cache_salt s1")
    assert not listed(), "without the salt the tenant's chunks are not found"
    assert not listed(cache_salt="s2")

    other_tenant = a.complete(prompt, max_tokens=16, cache_salt="s2")
    assert a.hit_for(other_tenant).hit == 0, "another salt never loads the first tenant's KV"
    assert output_text(other_tenant) == expected
    again = a.complete(prompt, max_tokens=16, cache_salt="s1")
    assert a.assert_loaded(again).hit >= num_tokens - CHUNK
    assert output_text(again) == expected


def streamed_pieces(server: VLLMServer, prompt: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """A streamed greedy completion's pieces as they arrive; leaving the loop early closes the stream, which
    aborts the request in vLLM."""
    import httpx
    import json

    body = {"model": server.model, "prompt": prompt, "temperature": 0, "stream": True, **fields}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=180) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


def test_two_concurrent_requests_sharing_a_long_prefix(servers: dict[str, Any], long_text: str) -> None:
    """The first request is still decoding when the second, with the same long prefix and another question,
    arrives: the second loads the prefix the first stored, and both answers are those of vLLM alone.

    The first decodes until the context is full and is aborted once the second has its first token: the overlap
    that matters is the second's lookup and load while the first runs, over by the second's first token, so the
    first has a whole context of steps to outlast one prefill (a CI run once saw a second that took until the
    first had filled its context, timed to its last token; the figures in the overlap's message say where)."""
    import threading

    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    prefix = prompt_of(long_text[120_000:], 6_000, "concurrent")
    first_prompt = prefix + "\n\nQuestion one: what is this text about?"
    second_prompt = prefix + "\n\nQuestion two: which names does it define?"
    expected_second = output_text(ref.complete(second_prompt, max_tokens=16))
    until_full = {"max_tokens": 4096 - len(a.tokenize(first_prompt)) - 1, "ignore_eos": True}

    first: dict[str, Any] = {"text": "", "pieces": 0, "finished": False}
    first_token, stop_first, first_closed = threading.Event(), threading.Event(), threading.Event()

    def stream_first() -> None:
        try:
            for piece in streamed_pieces(a, first_prompt, **until_full):
                first["text"] += piece["choices"][0]["text"]
                first["pieces"] += 1
                first_token.set()  # the prefill (and its store, done before the step returns) is over
                if stop_first.is_set():
                    break  # closing the stream aborts the request in vLLM
            else:
                first["finished"] = True
        finally:
            first_closed.set()

    thread = threading.Thread(target=stream_first, daemon=True)
    thread.start()
    assert first_token.wait(120), "the first request produced no token"
    second: dict[str, Any] = {"id": None, "text": ""}
    overlap: dict[str, Any] = {"first_pieces_at_send": first["pieces"]}
    sent = time.perf_counter()
    for piece in streamed_pieces(a, second_prompt, max_tokens=16):
        if second["id"] is None:  # the second's lookup and load are over: was the first still running?
            overlap.update(first_finished=first["finished"], first_pieces=first["pieces"],
                           second_ttft_s=round(time.perf_counter() - sent, 3))
            stop_first.set()
        second["id"] = piece["id"]
        second["text"] += piece["choices"][0]["text"]
    overlap["second_done_s"] = round(time.perf_counter() - sent, 3)
    stop_first.set()
    assert first_closed.wait(180), "the first stream did not close"
    assert second["id"] is not None, "the second request streamed no token"
    completion = {"id": second["id"], "choices": [{"text": second["text"]}]}
    hit = a.assert_loaded(completion)
    assert hit.hit >= len(a.tokenize(prefix)) - CHUNK, hit
    assert second["text"] == expected_second
    assert not overlap["first_finished"], \
        f"the first request filled its context ({until_full['max_tokens']} tokens) before the second's first " \
        f"token: {overlap}; the server's last KVMesh warnings:\n{a.kvmesh_warnings()}"
    # Each piece carries at least one token; the last few may still sit in the streaming detokenizer.
    compared = first["pieces"] - 4
    if compared > 0:
        expected_first = output_text(ref.complete(first_prompt, max_tokens=compared, ignore_eos=True))
        assert first["text"].startswith(expected_first), (first["text"], expected_first)


def test_a_dead_mesh_never_fails_a_request(servers: dict[str, Any], long_text: str) -> None:
    """Last in the module: NATS, the controller and the stores die; requests still succeed, and what the
    instance's own CPU tier holds is still loaded (the scheduler learns of it from vLLM's step outputs, not
    from NATS)."""
    a: VLLMServer = servers["a"]
    ref: VLLMServer = servers["ref"]
    in_cpu = prompt_of(long_text[100_000:], 6_000, "cpu-before-the-mesh-dies")
    expected_in_cpu = output_text(ref.complete(in_cpu, max_tokens=16))
    assert output_text(a.complete(in_cpu, max_tokens=16)) == expected_in_cpu
    prompt = prompt_of(long_text[80_000:], 6_000, "dead-mesh")
    expected = output_text(ref.complete(prompt, max_tokens=16))
    servers["mesh"].stop()
    for _ in range(2):  # cold, then again: lower-tier lookups and write-behind fail; the CPU tier serves
        assert output_text(a.complete(prompt, max_tokens=16)) == expected
    warm = a.complete(in_cpu, max_tokens=16)
    assert a.assert_loaded(warm).hit >= warm["usage"]["prompt_tokens"] - CHUNK
    assert output_text(warm) == expected_in_cpu
    assert a.alive()
