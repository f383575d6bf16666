"""A seeded simulation of vLLM driving KVMeshConnector (FoundationDB-style): one `random.Random(seed)` decides
a whole schedule, invariants are checked after every step, and a failing seed replays exactly.

What is real: the connector's two halves (tests/support/connector_driver.py), one CacheEngine per simulated TP rank
with its own paged KV cache (CPU layout), and, where a schedule asks for it, NATS and a disk store process
(`disk_store_mesh`). What is simulated: vLLM's scheduler (a block allocator with reuse, chunked prefill under a
token budget, preemption, aborts, decode, async loads through WAITING_FOR_REMOTE_KVS, and the "recompute"
policy for load errors: `_update_requests_with_invalid_blocks`) and the model's forward.

The forward writes each computed token's KV as a function of (token id, position, rank, layer, the request's
key extras) and a digest of the KV actually present in the paged caches for the token before it: one wrong
block makes every later token differ from the oracle, which computes the same function from the true inputs.
With two ranks that digest covers the token before's KV on *every* rank (tensor parallelism all-reduces the
hidden states after each layer), so a wrong block on one rank makes the other rank's later KV wrong too. The
ranks' worker steps run on threads that meet where vLLM's ranks meet: in the connector's load agreement
(`ThreadAgreement`, installed as each worker half's `_agreement`) and before each layer's forward (which reads
every rank's cache).

Invariants, after every step:
  1. every block vLLM will read (the computed tokens of every request that holds blocks, after load errors are
     applied) holds the oracle's KV for its tokens;
  2. every chunk in every CPU tier, and every chunk file of the disk store, holds the oracle's KV for the
     tokens and extras its key was made from (and has a key some request's tokens make);
  3. no exception escapes a connector method.

Determinism: faults happen at steps the seed picks; waits for asynchronous work (the scheduler's lower-tier
lookups, async fetches, write-behind, prefetches) are by condition, so the step sequence does not depend on
timing. `run_seed(seed)` returns a `SimResult`; `SimFailure` names the seed, step, invariant and request/key.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import signal
import tempfile
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvmesh.services.engine.adapter.request_extras import request_extras
from kvmesh.services.engine.adapter.scheduler_lookup import CpuTierEvents, engines
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.kv_layout import cpu_token_views, detect_layout
from kvmesh.services.engine.core.layerwise_load import LayerwiseLoader
from kvmesh.shared import chunk_file
from kvmesh.shared.keys import ChunkHasher, ChunkKey, KeyParams
from kvmesh.shared.protocol import LOCAL_DISK

from support.connector_driver import Step, blocks, request, run_worker_step, scheduler_half, worker_half
from support.engine import BLOCK, CHUNK, HEAD_SIZE, HEADS, LAYERS, disk_store_mesh, engine_config
from support.waiting import wait_until

MODEL = "test-model"
VOCAB = 1000
# bf16 bit patterns of the integers -64..63 (exact in bf16): the forward's values, compared bit for bit
_LUT = torch.arange(-64, 64, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy().copy()
_MULT = (np.arange(1, HEADS * 2 * HEAD_SIZE + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
_START = b"\0" * 8  # the digest before a sequence's first token
# how long a rank waits for the others at a meeting point: past any load deadline a schedule sets, so it is
# reached only when a rank never comes (then the step fails instead of hanging)
_RANK_WAIT_S = 120.0


class SimFailure(AssertionError):
    """An invariant broke: `seed`, `step`, `invariant` (1, 2 or 3) and what broke it."""

    def __init__(self, seed: int, step: int, invariant: int, detail: str) -> None:
        self.seed, self.step, self.invariant, self.detail = seed, step, invariant, detail
        super().__init__(f"seed {seed}, step {step}: invariant {invariant} broken: {detail}\n"
                         f"replay: python tests/engine/fuzz.py --seed {seed}  (or: make fuzz SEED={seed})")


# ---- the model: each token's KV, and the oracle --------------------------------------------------------------
def _digest(bits: np.ndarray) -> bytes:
    return hashlib.blake2b(bits.tobytes(), digest_size=8).digest()


def token_kv(rank: int, layer: int, tag: str, pos: int, token: int, prev: bytes) -> np.ndarray:
    """One token's KV in one layer ([heads, 2, head_size] bf16 bits), from its inputs and the digest of the KV
    of the token before it (`prev`: every rank's, see `joint_digest`)."""
    seed = hashlib.blake2b(f"{rank}|{layer}|{tag}|{pos}|{token}".encode() + prev, digest_size=8).digest()
    h = np.uint64(int.from_bytes(seed, "little"))
    ints = ((_MULT * h) >> np.uint64(57)).astype(np.int64)  # 0..127
    return _LUT[ints].reshape(HEADS, 2, HEAD_SIZE)


def joint_digest(values: list[np.ndarray]) -> bytes:
    """What the next token's KV depends on: the digests of this token's KV on every rank, in rank order (one
    rank: its own digest, so single-rank schedules compute what they always did)."""
    return b"".join(_digest(v) for v in values)


def step_kv(world_size: int, layer: int, tag: str, pos: int, token: int, prev: bytes) -> list[np.ndarray]:
    """One token's KV in one layer on every rank, from the same joint context `prev` (as after an all-reduce)."""
    return [token_kv(rank, layer, tag, pos, token, prev) for rank in range(world_size)]


class Oracle:
    """The KV every token of a sequence must have on every rank, from scratch (memoized per token and prefix
    digest)."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self._memo: dict[tuple[int, str, int, int, bytes], tuple[list[np.ndarray], bytes]] = {}
        self._seqs: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def kv(self, rank: int, tag: str, tokens: tuple[int, ...]) -> np.ndarray:
        """[len(tokens), layers, heads, 2, head_size] bf16 bits of `rank`."""
        key = (tag, tokens)
        got = self._seqs.get(key)
        if got is not None:
            return got[rank]
        out = np.empty((self.world_size, len(tokens), LAYERS, HEADS, 2, HEAD_SIZE), dtype=np.int16)
        for layer in range(LAYERS):
            prev = _START
            for pos, token in enumerate(tokens):
                m = (layer, tag, pos, token, prev)
                hit = self._memo.get(m)
                if hit is None:
                    values = step_kv(self.world_size, layer, tag, pos, token, prev)
                    hit = self._memo[m] = (values, joint_digest(values))
                for r, value in enumerate(hit[0]):
                    out[r, pos, layer] = value
                prev = hit[1]
        if len(self._seqs) > 4096:
            self._seqs.clear()
        self._seqs[key] = out
        return out[rank]


class ThreadAgreement:
    """The connector's RankAgreement (load_agreement.py) for ranks simulated on threads of one process: an
    element-wise minimum over `world_size` callers that meet at a barrier, as the gloo all-reduce does. One
    instance per schedule, shared by its ranks' worker halves. A call whose list differs in length from the
    other ranks' (the connector broke the protocol: every rank must pass the same loads) is recorded in
    `errors`, since the connector swallows what `min_over_ranks` raises."""

    def __init__(self, world_size: int, timeout: float = _RANK_WAIT_S) -> None:
        self.world_size = world_size
        self.calls = 0  # rounds completed
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._pending: list[list[int]] = []
        self._result: list[int] = []
        self._barrier = threading.Barrier(world_size, action=self._reduce, timeout=timeout)

    def _reduce(self) -> None:  # run by one thread once every rank arrived, before any is released
        pending, self._pending = self._pending, []
        if len({len(v) for v in pending}) != 1:
            self.errors.append(f"min_over_ranks called with lists of lengths {[len(v) for v in pending]}")
            raise ValueError(self.errors[-1])
        self._result = [min(col) for col in zip(*pending)]
        self.calls += 1

    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        with self._lock:
            self._pending.append(list(values))
        self._barrier.wait()
        # safe to read: the next round's _reduce needs this thread at the barrier again
        return list(self._result)

    def abort(self) -> None:
        """A rank failed: the others stop waiting for it (BrokenBarrierError) instead of hanging."""
        self._barrier.abort()


class Paged:
    """One rank's paged KV cache (vLLM's CPU layout), starting as random garbage; per-token reads and writes."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.buffer = torch.randn((LAYERS, num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE), generator=gen).to(torch.bfloat16)
        self.caches = {f"model.layers.{i}.self_attn": self.buffer[i] for i in range(LAYERS)}
        self.layout = detect_layout(self.caches, BLOCK, "CPU_ATTN", cpu_isa="vec")
        self.k, self.v = cpu_token_views(self.buffer.view(torch.int16), self.layout)  # [L, nb, N, H, D]

    def read(self, block_ids: list[int], num_tokens: int) -> np.ndarray:
        """The KV of tokens [0, num_tokens) of a request with these blocks: [n, L, H, 2, D]."""
        pos = torch.arange(num_tokens)
        b = torch.as_tensor(block_ids, dtype=torch.int64)[pos // BLOCK]
        off = pos % BLOCK
        kv = torch.stack([self.k[:, b, off], self.v[:, b, off]], dim=3)  # [L, n, H, 2, D]
        return kv.permute(1, 0, 2, 3, 4).numpy()

    def token(self, layer: int, block: int, off: int) -> np.ndarray:
        return torch.stack([self.k[layer, block, off], self.v[layer, block, off]], dim=1).numpy()

    def write(self, layer: int, block: int, off: int, bits: np.ndarray) -> None:
        value = torch.from_numpy(bits)
        self.k[layer, block, off] = value[:, 0]
        self.v[layer, block, off] = value[:, 1]


def chunk_tokens(chunk: torch.Tensor, layout: Any, num_tokens: int) -> np.ndarray:
    """A chunk tensor (layout.chunk_shape) as [num_tokens, L, H, 2, D] bf16 bits."""
    k, v = cpu_token_views(chunk.view(torch.int16), layout)  # [L, blocks, N, H, D]
    kv = torch.stack([k, v], dim=4)  # [L, blocks, N, H, 2, D]
    kv = kv.reshape(kv.shape[0], -1, *kv.shape[3:])[:, :num_tokens]
    return kv.permute(1, 0, 2, 3, 4).numpy()


# ---- the schedule's knobs --------------------------------------------------------------------------------------
@dataclass
class SimConfig:
    seed: int
    world_size: int = 1
    num_blocks: int = 32
    cpu_chunks: int = 16
    budget: int = 64  # tokens per step (chunked prefill)
    max_steps: int = 150
    num_requests: int = 10
    save_decode_cache: bool = False
    async_loading: bool = False
    layerwise: bool = False
    disk: bool = False
    p_evict: float = 0.0  # per step: a random chunk leaves one rank's CPU tier
    p_evict_hit: float = 0.0  # per hit: one of its chunks leaves a rank's CPU tier between lookup and load
    p_abort: float = 0.02
    p_unlink: float = 0.0  # per step: a random chunk file of the disk store is deleted
    p_clear: float = 0.0  # per step: a rank's CPU tier is emptied (what follows loads from the disk store)
    pause_at: int | None = None  # SIGSTOP the disk store at this step, SIGCONT `pause_steps` later
    pause_steps: int = 3
    kill_at: int | None = None  # kill the disk store at this step; restarted `kill_steps` later
    kill_steps: int = 3
    nats_down_at: int | None = None  # stop NATS at this step; started again `nats_steps` later
    nats_steps: int = 3
    # two ranks: the worker halves agree on their in-step loads (ThreadAgreement); False leaves the connector's
    # agreement out (as before it existed), to show what it prevents. Never drawn: a seed means the same either way
    agreement: bool = True

    @classmethod
    def draw(cls, seed: int, allow_processes: bool = True) -> "SimConfig":
        """The knobs of schedule `seed` (drawn from the same Random as the schedule, first)."""
        r = random.Random(seed)
        c = cls(seed)
        c.world_size = 2 if r.random() < 0.3 else 1
        c.num_blocks = r.choice([20, 28, 40])
        c.cpu_chunks = r.choice([6, 10, 16, 32])
        c.budget = r.choice([32, 48, 64, 100])
        c.max_steps = r.randint(60, 160)
        c.num_requests = r.randint(5, 14)
        c.save_decode_cache = r.random() < 0.4
        c.layerwise = r.random() < 0.25
        c.p_evict = r.choice([0.0, 0.0, 0.05, 0.15])
        c.p_evict_hit = r.choice([0.0, 0.0, 0.2, 0.5])
        c.p_abort = r.choice([0.0, 0.02, 0.05])
        # the same draws whether or not processes are allowed: a seed's other knobs never change with it
        disk, async_loading = r.random() < 0.3, r.random() < 0.5
        p_unlink = r.choice([0.0, 0.05, 0.15])
        fault, at = r.random(), r.randint(3, 20)
        p_clear = r.choice([0.0, 0.05, 0.15])
        if disk and allow_processes:
            c.disk, c.async_loading, c.p_unlink, c.p_clear = True, async_loading, p_unlink, p_clear
            if fault < 0.2:
                c.pause_at = at
            elif fault < 0.35:
                c.kill_at = at
            elif fault < 0.45:
                c.nats_down_at = at
        return c


# ---- the simulated vLLM request -------------------------------------------------------------------------------
WAITING, WAITING_FOR_REMOTE_KVS, RUNNING, PREEMPTED, FINISHED = "waiting", "wfrk", "running", "preempted", "done"


@dataclass
class SimRequest:
    rid: str
    ns: SimpleNamespace  # what the connector reads (vLLM's Request; all_token_ids grows in place)
    tag: str  # the extras the KV depends on (cache_salt, LoRA)
    max_new: int
    status: str = WAITING
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    generated: int = 0
    registered: int = 0  # tokens whose chunk keys are recorded

    @property
    def tokens(self) -> list[int]:
        return self.ns.all_token_ids


@dataclass
class SimResult:
    seed: int
    steps: int
    requests: int
    loads: int = 0  # requests that loaded something
    load_errors: int = 0
    preemptions: int = 0
    checked_chunks: int = 0
    agreements: int = 0  # steps whose ranks agreed on their in-step loads (two ranks)
    faults: list[str] = field(default_factory=list)


class Simulation:
    """One seeded schedule over real connector halves and engines; `run()` raises SimFailure on a violation."""

    def __init__(self, config: SimConfig, log: Callable[[str], None] | None = None) -> None:
        self.c = config
        self.r = random.Random(config.seed * 7919 + 1)  # the schedule (the knobs used Random(seed))
        self.log = log or (lambda _: None)
        self.step_no = 0
        self.oracle = Oracle(config.world_size)
        self.agreement: ThreadAgreement | None = None
        self.layer_barrier: threading.Barrier | None = None  # the ranks' forwards of a layer start together
        self.pool: ThreadPoolExecutor | None = None
        self.requests: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.free: list[int] = list(range(config.num_blocks))
        self.finished_ids: set[str] = set()  # reported in the next step's finished_req_ids
        self.held_for_load: dict[str, list[int]] = {}  # aborted while loading: blocks freed at finished_recving
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.recv_counts: dict[str, int] = {}
        self.prompts: list[tuple[list[int], str | None, Any]] = []  # earlier prompts (+output) with extras
        self.key_info: dict[ChunkKey, tuple[int, str, tuple[int, ...], int, int]] = {}
        self.disk_seen: dict[str, tuple[int, int, int]] = {}
        self.result = SimResult(config.seed, 0, 0)
        self.created = 0
        self.paused = False
        self.mesh: Any = None
        self.disk_dir: Path | None = None

    # ---- set-up -------------------------------------------------------------------------------------------------
    def _setup(self, stack: ExitStack) -> None:
        c = self.c
        overrides: dict[str, object] = {"cpu_chunks": c.cpu_chunks, "save_decode_cache": c.save_decode_cache,
                                        "enable_async_loading": c.async_loading}
        if c.disk:
            self.disk_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-sim-"))) / "disk"
            self.mesh = stack.enter_context(disk_store_mesh(self.disk_dir))
            overrides.update(nats_url=self.mesh.nats_url, local_disk=str(self.disk_dir))
            if c.pause_at is not None or c.kill_at is not None or c.nats_down_at is not None:
                # short deadlines: a store that does not answer costs a few seconds per step, not minutes
                overrides.update(request_timeout_secs=1.0, blocking_timeout_secs=2.0, disk_data_timeout_secs=1.0)
        config = engine_config(**overrides)
        self.pageds = [Paged(c.num_blocks, c.seed * 31 + rank) for rank in range(c.world_size)]
        self.engines: list[CacheEngine] = []
        for rank, paged in enumerate(self.pageds):
            engine = CacheEngine(config, KeyParams(MODEL, "", c.world_size, rank), paged.layout)
            stack.callback(engine.close)
            engines.add(rank, engine)
            stack.callback(engines.remove, engine)
            self.engines.append(engine)
        for engine in self.engines:
            if c.disk:
                assert engine.wait_connected(30.0), "engine never reached NATS"
                wait_until(lambda e=engine: e.storage.lower(LOCAL_DISK), what="the disk store client")
        fmt = self.engines[0].key_params.kv_format
        self.hashers = [ChunkHasher(KeyParams(MODEL, fmt, c.world_size, r), CHUNK) for r in range(c.world_size)]
        self.sched = scheduler_half(config, BLOCK, saves_off_forward=False, world_size=c.world_size)
        stack.callback(self.sched.shutdown)
        self.workers = []
        for engine, paged in zip(self.engines, self.pageds):
            work = worker_half(engine, paged.caches, BLOCK, saves_off_forward=False,
                               load_timeout=config.blocking_timeout_secs)
            if c.layerwise:  # what register_kv_caches sets up on CUDA with use_layerwise; here on CPU
                work.worker_side.layerwise = LayerwiseLoader(paged.layout, torch.device("cpu"))
                stack.callback(work.worker_side.layerwise.close)
            stack.callback(work.worker_side.async_loads.abandon_all)
            self.workers.append(work)
        if c.world_size > 1:
            # each rank's worker step on its own thread, as vLLM's ranks run in their own processes
            self.pool = stack.enter_context(ThreadPoolExecutor(c.world_size, thread_name_prefix="sim-rank"))
            self.layer_barrier = threading.Barrier(c.world_size, timeout=_RANK_WAIT_S)
            if c.agreement:
                self.agreement = ThreadAgreement(c.world_size)
                for work in self.workers:
                    work.worker_side.agreement = self.agreement

    # ---- the run ------------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        with ExitStack() as stack:
            self._setup(stack)
            stack.callback(self._resume_processes)
            while self.step_no < self.c.max_steps:
                if self.created >= self.c.num_requests and not self.requests and not self.held_for_load:
                    break
                self.step_no += 1
                self._faults()
                self._arrivals()
                self._aborts()
                self._step()
                self._check()
            self.result.steps = self.step_no
            self.result.agreements = self.agreement.calls if self.agreement is not None else 0
            self.result.requests = self.created
        return self.result

    def fail(self, invariant: int, detail: str) -> SimFailure:
        return SimFailure(self.c.seed, self.step_no, invariant, detail)

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A connector method; an exception escaping it breaks invariant 3."""
        try:
            return fn(*args)
        except SimFailure:
            raise
        except Exception as exc:
            raise self.fail(3, f"{what} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc

    # ---- requests -----------------------------------------------------------------------------------------------
    def _arrivals(self) -> None:
        r = self.r
        while self.created < self.c.num_requests and len(self.requests) < 6 and r.random() < 0.35:
            self._new_request()

    def _new_request(self) -> None:
        r = self.r
        rid = f"r{self.created}"
        self.created += 1
        salt: str | None = None
        lora: Any = None
        kind = r.random() if self.prompts else 0.0
        if kind < 0.25:  # fresh
            tokens = self._fresh(r.randint(BLOCK // 2, 5 * CHUNK))
        else:
            base, salt, lora = r.choice(self.prompts)
            if kind < 0.4:  # the same prompt again
                tokens = list(base)
            elif kind < 0.7:  # extends it (a block-prefix hit when it ended inside a chunk)
                tokens = list(base) + self._fresh(r.randint(1, 2 * CHUNK))
            else:  # diverges from it somewhere
                cut = r.randint(1, max(1, len(base) - 1))
                tokens = list(base[:cut]) + self._fresh(r.randint(1, 2 * CHUNK))
            if r.random() < 0.25:  # the same tokens under other extras must never hit its KV
                salt, lora = self._extras()
        if kind < 0.25:
            salt, lora = self._extras() if r.random() < 0.4 else (None, None)
        tokens = tokens[: 7 * CHUNK]
        ns = request(rid, tokens, cache_salt=salt, lora_request=lora)
        tag = f"salt={salt}|lora={lora.lora_name if lora is not None else None}"
        req = SimRequest(rid, ns, tag, max_new=r.randint(1, 40))
        self.requests[rid] = req
        self.waiting.append(req)
        self.prompts.append((list(tokens), salt, lora))
        self._register_keys(req)
        self.log(f"step {self.step_no}: new {rid} ({len(tokens)} tokens, {tag}, max_new {req.max_new})")

    def _fresh(self, n: int) -> list[int]:
        return [self.r.randrange(VOCAB) for _ in range(n)]

    def _extras(self) -> tuple[str | None, Any]:
        r = self.r
        salt = r.choice([None, "tenant-a", "tenant-b"])
        lora = None
        if r.random() < 0.5:
            name = r.choice(["adapter-1", "adapter-2"])
            lora = SimpleNamespace(lora_name=name, lora_path=f"/nonexistent/{name}", lora_int_id=int(name[-1]))
        return salt, lora

    def _register_keys(self, req: SimRequest) -> None:
        """Record, per rank, which tokens and extras every key this request can store names: the chain's whole
        chunks and the partial last chunk of every prefix length (prompt ends, block prefixes)."""
        tokens = req.tokens
        if req.registered >= len(tokens):
            return
        extras = request_extras(req.ns, CHUNK)
        chain = self.hashers[0].chain(tokens, extras=extras)
        for end in range(max(1, req.registered + 1), len(tokens) + 1):
            span = self.hashers[0].prefix_span(tokens, chain, end, extras)
            for rank in range(self.c.world_size):
                key = self.hashers[rank].params.shard_key(span.key)
                self.key_info.setdefault(key, (rank, req.tag, tuple(tokens[:end]), span.start, end))
        req.registered = len(tokens)

    def _finish(self, req: SimRequest, why: str) -> None:
        """vLLM's _free_request: the connector hears of it; blocks freed (held while an async load runs)."""
        self.call("request_finished", self.sched.request_finished, req.ns, list(req.block_ids))
        if req.status == WAITING_FOR_REMOTE_KVS:
            self.held_for_load[req.rid] = req.block_ids
        else:
            self.free.extend(req.block_ids)
        req.block_ids = []
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = FINISHED
        del self.requests[req.rid]
        self.finished_ids.add(req.rid)
        self.prompts.append((list(req.tokens), req.ns.cache_salt, req.ns.lora_request))
        self.log(f"step {self.step_no}: {req.rid} {why}")

    def _aborts(self) -> None:
        if self.requests and self.r.random() < self.c.p_abort:
            req = self.requests[self.r.choice(sorted(self.requests))]
            self._finish(req, "aborted")

    # ---- blocks -------------------------------------------------------------------------------------------------
    def _allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):  # a random free block: freed blocks are reused soon, by anyone
            out.append(self.free.pop(self.r.randrange(len(self.free))))
        return out

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.free.extend(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.status = PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.result.preemptions += 1
        self.log(f"step {self.step_no}: {req.rid} preempted")

    # ---- one engine step ----------------------------------------------------------------------------------------
    def _step(self) -> None:
        step = Step(finished=set(self.finished_ids))
        self.finished_ids = set()
        budget = self.c.budget
        scheduled: dict[str, int] = {}
        starts: dict[str, int] = {}
        preempted: set[str] = set()
        for req in list(self.running):
            if req not in self.running or budget <= 0:
                continue
            n = min(len(req.tokens) - req.num_computed, budget)
            if n <= 0:
                continue
            need = -(-(req.num_computed + n) // BLOCK) - len(req.block_ids)
            while need > len(self.free):
                victim = next((v for v in reversed(self.running) if v.rid not in scheduled), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.add(victim.rid)
                if victim is req:
                    break
            if req.status != RUNNING or need > len(self.free):
                continue
            new_blocks = self._allocate(max(need, 0))
            req.block_ids += new_blocks
            step.cached.append((req.rid, new_blocks, req.num_computed, n, False))
            scheduled[req.rid], starts[req.rid] = n, req.num_computed
            budget -= n
        if not preempted:
            self._schedule_waiting(step, scheduled, starts, budget)
        step.preempted = preempted
        for rid, n in scheduled.items():
            self.requests[rid].num_computed += n
        self._execute(step, scheduled, starts)

    def _schedule_waiting(self, step: Step, scheduled: dict[str, int], starts: dict[str, int], budget: int) -> None:
        for req in list(self.waiting):
            if budget <= 0:
                break
            if req.status == WAITING_FOR_REMOTE_KVS:
                if req.rid not in self.finished_recving:
                    continue
                self._update_waiting_for_remote_kv(req)
            ext, load_async = 0, False
            if req.num_computed == 0:
                ext, load_async = self.call("get_num_new_matched_tokens", self.sched.get_num_new_matched_tokens,
                                            req.ns, 0)
                if ext is None:  # "ask again": vLLM skips it this step; wait for the answer so the next step has it
                    self._wait_lookup(req)
                    continue
                if ext:
                    self.result.loads += 1
                    self._evict_hit(req, ext)
            computed = req.num_computed + ext
            n = 0 if load_async else min(len(req.tokens) - computed, budget)
            need = -(-(computed + n) // BLOCK) - len(req.block_ids)
            if need > len(self.free):
                break  # vLLM stops admitting when allocation fails
            new_blocks = self._allocate(max(need, 0))
            req.block_ids += new_blocks
            self.call("update_state_after_alloc", self.sched.update_state_after_alloc, req.ns,
                      blocks(req.block_ids), ext)
            if load_async:
                req.status, req.num_computed = WAITING_FOR_REMOTE_KVS, computed
                self.log(f"step {self.step_no}: {req.rid} waits for an async load of {ext} tokens")
                continue
            self.waiting.remove(req)
            self.running.append(req)
            if req.status == PREEMPTED:
                step.cached.append((req.rid, list(req.block_ids), computed, n, True))
            else:
                step.new.append((req.rid, list(req.block_ids), computed, n))
            req.status, req.num_computed = RUNNING, computed
            scheduled[req.rid], starts[req.rid] = n, computed
            budget -= n

    def _update_waiting_for_remote_kv(self, req: SimRequest) -> None:
        """vLLM's _update_waiting_for_remote_kv: a failed load keeps what was valid (or frees the blocks)."""
        self.finished_recving.discard(req.rid)
        if req.rid in self.failed_recving:
            self.failed_recving.discard(req.rid)
            if not req.num_computed:
                self.free.extend(req.block_ids)
                req.block_ids = []
        if req.num_computed == len(req.tokens):
            req.num_computed -= 1
        req.status = PREEMPTED if req.num_preemptions else WAITING

    def _wait_lookup(self, req: SimRequest) -> None:
        tracker = self.sched.scheduler_side.tracker(req.rid)
        lookups = [tracker.lower] if tracker is not None and tracker.lower is not None else []
        if tracker is not None and tracker.probe is not None:
            lookups += [lower for lower in tracker.probe.lowers if lower is not None]
        timeout = self.sched.scheduler_side.lookup.timeout
        wait_until(lambda: all(lower.result() is not None for lower in lookups),
                   timeout=timeout + 5, what=f"{req.rid}'s lower-tier lookup")

    def _execute(self, step: Step, scheduled: dict[str, int], starts: dict[str, int]) -> None:
        output = step.output()
        metadata = self.call("build_connector_meta", self.sched.build_connector_meta, output)
        wire = pickle.dumps(metadata)  # each worker gets its own copy, as over vLLM's IPC
        invalid: set[int] = set()
        worker_meta: CpuTierEvents | None = None
        recving: list[str] = []
        for result in self._worker_steps(wire, set(step.finished), scheduled, starts):
            invalid |= result.load_errors
            recving += result.finished_recving
            if result.worker_meta is not None:
                worker_meta = result.worker_meta if worker_meta is None else worker_meta.aggregate(result.worker_meta)
        self._quiesce()
        self._update_from_output(scheduled, invalid, recving, worker_meta)

    def _worker_steps(self, wire: bytes, finished: set[str], scheduled: dict[str, int],
                      starts: dict[str, int]) -> list[Any]:
        """Every rank's worker step; with several ranks concurrently, on one thread each, joined here. What they
        compute does not depend on thread timing: they meet in the load agreement and before each layer."""
        def one(rank: int) -> Any:
            work = self.workers[rank]
            forward = self._forward(rank, scheduled, starts)
            try:
                return self.call(f"worker step (rank {rank})", run_worker_step, work, pickle.loads(wire),
                                 set(finished), forward, lambda: self._wait_async_loads(work))
            except BaseException:
                self._abort_ranks()  # the other ranks would wait for this one at a barrier
                raise

        if self.pool is None:
            return [one(0)]
        futures = [self.pool.submit(one, rank) for rank in range(self.c.world_size)]
        outcomes: list[tuple[Any, BaseException | None]] = []
        for future in futures:
            exc = future.exception()
            outcomes.append((None if exc is not None else future.result(), exc))
        errors = [exc for _, exc in outcomes if exc is not None]
        if errors:  # the rank that failed first, not one that only saw a broken barrier because of it
            raise min(errors, key=lambda e: "BrokenBarrierError" in str(e))
        if self.agreement is not None and self.agreement.errors:
            raise self.fail(3, f"the ranks' load agreement: {self.agreement.errors[0]}")
        return [result for result, _ in outcomes]

    def _abort_ranks(self) -> None:
        if self.layer_barrier is not None:
            self.layer_barrier.abort()
        if self.agreement is not None:
            self.agreement.abort()

    def _forward(self, rank: int, scheduled: dict[str, int], starts: dict[str, int]) -> Callable[[int, str], None]:
        paged, pageds, world = self.pageds[rank], self.pageds, self.c.world_size

        def forward(layer: int, name: str) -> None:
            if self.layer_barrier is not None:
                # every rank has loaded this layer (start_load_kv, or its layer-wise copies) before any rank's
                # forward reads it; the reads (the token before each scheduled one) and the writes (the scheduled
                # tokens) touch different tokens, so no rank's writes race another's reads
                self.layer_barrier.wait()
            for rid, n in scheduled.items():
                req = self.requests[rid]
                start = starts[rid]
                if start:
                    p = start - 1
                    block, off = req.block_ids[p // BLOCK], p % BLOCK
                    prev = joint_digest([other.token(layer, block, off) for other in pageds])
                else:
                    prev = _START
                for pos in range(start, start + n):
                    values = step_kv(world, layer, req.tag, pos, req.tokens[pos], prev)
                    paged.write(layer, req.block_ids[pos // BLOCK], pos % BLOCK, values[rank])
                    prev = joint_digest(values)

        return forward

    def _wait_async_loads(self, work: Any) -> None:
        """Before get_finished: every fetch started so far has ended or passed its deadline (no timing races)."""
        loads = work.worker_side.async_loads
        pending = loads.pending()
        wait_until(lambda: all(p.future.done() or time.monotonic() >= p.deadline for p in pending),
                   timeout=loads.timeout + 10, what="the async fetches")

    def _quiesce(self) -> None:
        """Write-behind and prefetches of every engine settled, so the next step does not depend on timing."""
        for engine in self.engines:
            if engine.nats_loop is None or engine.storage is None or self.paused:
                continue
            engine.wait_write_behind(30.0)
            wait_until(lambda e=engine: not e.storage._inflight, timeout=30.0, what="prefetches settled")

    def _update_from_output(self, scheduled: dict[str, int], invalid: set[int], recving: list[str],
                            worker_meta: CpuTierEvents | None) -> None:
        failed_sync: set[str] = set()
        if invalid:
            self.result.load_errors += 1
            self.log(f"step {self.step_no}: load errors in blocks {sorted(invalid)}")
            # vLLM's _handle_invalid_blocks: async loads first (nothing scheduled), then the running requests
            for req in [q for q in self.waiting if q.status == WAITING_FOR_REMOTE_KVS]:
                if self._truncate(req, invalid, 0):
                    self.failed_recving.add(req.rid)
            for req in self.running:
                if self._truncate(req, invalid, scheduled.get(req.rid, 0)):
                    failed_sync.add(req.rid)
        for rid, n in scheduled.items():  # sampling: a request that computed its last token gets a new one
            req = self.requests.get(rid)
            if req is None or rid in failed_sync or req.num_computed < len(req.tokens):
                continue
            req.generated += 1
            if req.generated > req.max_new:
                self._finish(req, "finished")
                continue
            req.ns.all_token_ids.append(self.r.randrange(VOCAB))
            req.ns.num_tokens = len(req.ns.all_token_ids)
            self._register_keys(req)
        self.call("update_connector_output", self.sched.update_connector_output,
                  SimpleNamespace(kv_connector_worker_meta=worker_meta, invalid_block_ids=set(invalid)))
        for rid in recving:  # vLLM's aggregator: reported once every rank reported it
            self.recv_counts[rid] = self.recv_counts.get(rid, 0) + 1
            if self.recv_counts[rid] < self.c.world_size:
                continue
            del self.recv_counts[rid]
            if rid in self.held_for_load:
                self.free.extend(self.held_for_load.pop(rid))
            elif rid in self.requests and self.requests[rid].status == WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(rid)

    def _truncate(self, req: SimRequest, invalid: set[int], num_scheduled: int) -> bool:
        """vLLM's _update_requests_with_invalid_blocks for one request (recompute policy)."""
        before = req.num_computed - num_scheduled
        for idx, block in enumerate(req.block_ids[: -(-before // BLOCK)]):
            if block in invalid:
                req.num_computed = idx * BLOCK
                self.log(f"step {self.step_no}: {req.rid} rewinds to token {req.num_computed} (load error)")
                return True
        return False

    # ---- faults -------------------------------------------------------------------------------------------------
    def _cpu_keys(self, rank: int) -> list[ChunkKey]:
        return sorted(self.engines[rank].cpu.held_keys())

    def _evict_hit(self, req: SimRequest, ext: int) -> None:
        """Between the lookup and the load: one chunk of the hit leaves one rank's (or every) CPU tier."""
        if self.r.random() >= self.c.p_evict_hit:
            return
        tracker = self.sched.scheduler_side.tracker(req.rid)
        if tracker is None or not tracker.chain:
            return
        span = self.r.choice([s for s in tracker.chain if s.start < ext] or tracker.chain)
        ranks = [self.r.randrange(self.c.world_size)] if self.r.random() < 0.5 else range(self.c.world_size)
        for rank in ranks:
            key = self.hashers[rank].params.shard_key(span.key)
            if self.engines[rank].cpu.remove(key):
                self.result.faults.append(f"step {self.step_no}: rank {rank} evicted chunk {span.index} of "
                                          f"{req.rid}'s hit")

    def _faults(self) -> None:
        c, r = self.c, self.r
        if r.random() < c.p_evict:
            rank = r.randrange(c.world_size)
            keys = self._cpu_keys(rank)
            if keys:
                self.engines[rank].cpu.remove(r.choice(keys))
                self.result.faults.append(f"step {self.step_no}: rank {rank} lost a CPU-tier chunk")
        if not c.disk:
            return
        if r.random() < c.p_clear:
            rank = r.randrange(c.world_size)
            self.engines[rank].cpu.clear_all()
            self.result.faults.append(f"step {self.step_no}: rank {rank}'s CPU tier emptied")
        if r.random() < c.p_unlink and self.disk_dir is not None:
            files = sorted(self.disk_dir.rglob("*" + chunk_file.SUFFIX))
            if files:
                r.choice(files).unlink(missing_ok=True)
                self.result.faults.append(f"step {self.step_no}: a chunk file deleted")
        store = self.mesh.processes[0]
        if c.pause_at == self.step_no:
            store.send_signal(signal.SIGSTOP)
            self.paused = True
            self.result.faults.append(f"step {self.step_no}: disk store paused")
        if c.pause_at is not None and c.pause_at + c.pause_steps == self.step_no:
            self._stalled_past_timeout()
            store.send_signal(signal.SIGCONT)
            self.paused = False
            self._store_answers()
            self.result.faults.append(f"step {self.step_no}: disk store resumed")
        if c.kill_at == self.step_no:
            store.kill()
            store.wait()
            self.result.faults.append(f"step {self.step_no}: disk store killed")
        if c.kill_at is not None and c.kill_at + c.kill_steps == self.step_no:
            self.mesh.respawn(0)
            self._store_answers()
            self.result.faults.append(f"step {self.step_no}: disk store restarted")
        if c.nats_down_at == self.step_no:
            self.mesh._nats.stop()
            self.result.faults.append(f"step {self.step_no}: NATS stopped")
        if c.nats_down_at is not None and c.nats_down_at + c.nats_steps == self.step_no:
            self.mesh._nats.start()
            for engine in self.engines:
                wait_until(lambda e=engine: e.connected, timeout=30.0, what="the engine reconnected to NATS")
            self._store_answers()
            self.result.faults.append(f"step {self.step_no}: NATS started again")

    def _stalled_past_timeout(self) -> None:
        """Before a paused store resumes: the engines gave up on what they asked it (their fetches ended and
        the slots they lent it are free again, or kept back for good), so its late answers meet reused slots."""
        def given_up() -> bool:
            for engine in self.engines:
                pool, cpu = engine.pool, engine.cpu
                if engine.storage._inflight or pool.num_slots - pool.num_free != len(cpu):
                    return False
            return True

        try:
            wait_until(given_up, timeout=15.0, what="the engines gave up on the paused store")
        except TimeoutError:  # slots kept out of use until the store settles them (the fix for finding 2)
            pass

    def _store_answers(self) -> None:
        """Wait until the disk store answers this engine again (it has worked off what queued meanwhile)."""
        def answers() -> bool:
            engine = self.engines[0]
            client = engine.storage.lower(LOCAL_DISK) if engine.storage is not None else None
            if client is None or engine.nats_loop is None or not engine.connected:
                return False
            return engine.nats_loop.call(_answers(client), 3.0, default=False)

        wait_until(answers, timeout=60.0, what="the disk store answers again")

    def _resume_processes(self) -> None:
        if self.paused and self.mesh is not None and self.mesh.processes:
            self.mesh.processes[0].send_signal(signal.SIGCONT)
            self.paused = False

    # ---- invariants ---------------------------------------------------------------------------------------------
    def _check(self) -> None:
        self._check_blocks()
        self._check_cpu_tiers()
        if self.c.disk and not self.paused:
            self._check_disk()

    def _check_blocks(self) -> None:
        for req in list(self.requests.values()):
            if req.status == WAITING_FOR_REMOTE_KVS or not req.num_computed:
                continue
            n = req.num_computed
            for rank, paged in enumerate(self.pageds):
                got = paged.read(req.block_ids, n)
                want = self.oracle.kv(rank, req.tag, tuple(req.tokens[:n]))
                bad = np.nonzero(np.any((got != want).reshape(n, -1), axis=1))[0]
                if bad.size:
                    p = int(bad[0])
                    raise self.fail(1, f"request {req.rid} ({req.status}, rank {rank}): token {p} (block "
                                       f"{req.block_ids[p // BLOCK]}, logical block {p // BLOCK}) of its "
                                       f"{n} computed tokens is not the oracle's KV ({bad.size} tokens wrong)")

    def _check_chunk(self, where: str, key: ChunkKey, data: np.ndarray) -> None:
        info = self.key_info.get(key)
        if info is None:
            raise self.fail(2, f"{where}: chunk {key.hex()} has a key no request's tokens make")
        rank, tag, tokens, start, end = info
        want = self.oracle.kv(rank, tag, tokens)[start:end]
        self.result.checked_chunks += 1
        if data.shape != want.shape or not np.array_equal(data, want):
            wrong = (np.nonzero(np.any((data != want).reshape(len(want), -1), axis=1))[0]
                     if data.shape == want.shape else [])
            raise self.fail(2, f"{where}: chunk {key.hex()} (rank {rank}, {tag}, tokens [{start}, {end}) of a "
                               f"{len(tokens)}-token sequence) is not the oracle's KV (tokens wrong: "
                               f"{[int(t) + start for t in wrong[:8]]}, shape {data.shape} vs {want.shape})")

    def _check_cpu_tiers(self) -> None:
        for rank, engine in enumerate(self.engines):
            cpu, layout = engine.cpu, engine.layout
            with cpu._lock:  # a peek that does not count as a hit (the eviction order stays the schedule's)
                entries = [(key, ref) for key, ref in cpu._entries.items()]
                for _, ref in entries:
                    ref.slot.ref()
            try:
                for key, ref in entries:
                    meta = ref.meta
                    chunk = ref.slot.view(layout.dtype, layout.chunk_shape(meta.num_tokens))
                    self._check_chunk(f"rank {rank}'s CPU tier", key, chunk_tokens(chunk, layout, meta.num_tokens))
            finally:
                for _, ref in entries:
                    ref.slot.release()

    def _check_disk(self) -> None:
        assert self.disk_dir is not None
        layout = self.engines[0].layout
        for path in sorted(self.disk_dir.rglob("*" + chunk_file.SUFFIX)):
            try:
                st = path.stat()
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                if self.disk_seen.get(str(path)) == stamp:
                    continue
                meta, _ = chunk_file.read_chunk_meta(path)
                out = bytearray(meta.nbytes)
                meta = chunk_file.read_chunk_into(path, memoryview(out))
            except FileNotFoundError:  # evicted or deleted meanwhile
                continue
            except chunk_file.CorruptChunkFile as exc:
                raise self.fail(2, f"disk store: {path.name} is corrupt ({exc})") from exc
            self.disk_seen[str(path)] = stamp
            chunk = torch.frombuffer(out, dtype=torch.uint8).view(layout.dtype).reshape(list(meta.shape))
            self._check_chunk(f"disk store file {path.name}", meta.key, chunk_tokens(chunk, layout, meta.num_tokens))


async def _answers(client: Any) -> bool:
    try:
        await client.contains([b"\0" * 16])
        return True
    except Exception:
        return False


def run_seed(seed: int, allow_processes: bool = True, log: Callable[[str], None] | None = None,
             **overrides: Any) -> SimResult:
    """Run schedule `seed` (its knobs drawn from the seed, then `overrides`); SimFailure on a violation."""
    config = SimConfig.draw(seed, allow_processes)
    for name, value in overrides.items():
        setattr(config, name, value)
    return Simulation(config, log).run()


__all__ = ["SimConfig", "SimFailure", "SimResult", "Simulation", "ThreadAgreement", "run_seed", "Oracle",
           "joint_digest", "step_kv", "token_kv"]
