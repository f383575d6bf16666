"""Two tensor-parallel ranks agree on how far a step's load got (services/engine/adapter/load_agreement.py).

Two real processes joined by torch.distributed (gloo, as vLLM's CPU groups), each a worker half over its own
cache engine holding its shard. A request loads 2 chunks and computes the next 2 in the same step; rank 0 lost
its second chunk between lookup and load. The forward on rank 1 computes over rank 0's wrong KV (hidden states
cross ranks), so rank 1 must not store its shard of chunks 2 and 3 either, and both ranks report the same load
errors. Without the agreement rank 1 stored them: the first copy of those keys would be wrong for good.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kvmesh.services.engine.connector")

from support.waiting import WAIT_S

TOKENS = 4 * 32  # four 32-token chunks
# The spawned ranks import this module (for `rank_step`) and the test helpers (support/, under tests/).
HELPERS_PATH = os.pathsep.join(str(folder) for folder in (Path(__file__).parent, Path(__file__).parents[2]))


def rank_step(rank: int, init_file: str, agree: bool, results: Any) -> None:
    """One rank: store the prompt's first 2 chunks (rank 0 then loses the second), then one step that loads
    them and computes and saves the next two."""
    import torch.distributed as dist

    from kvmesh.services.engine.adapter.load_agreement import CollectiveAgreement
    from kvmesh.services.engine.adapter.request_meta import KVMeshConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
    from kvmesh.services.engine.assembly import build_engine
    from kvmesh.services.engine.core import token_api
    from kvmesh.shared.protocol import LOCAL_CPU
    from kvmesh.shared.wire.keys import ChunkHasher, KeyParams

    from support.connector_driver import run_worker_step, worker_half
    from support.kv_oracle import ContextForward
    from support.engine import BLOCK, CHUNK, PagedKV, engine_config, random_tokens

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        kv = PagedKV(num_blocks=32, seed=rank)
        engine = build_engine(engine_config(), KeyParams("test-model", "", world_size=2, rank=rank), kv.layout,
                              use_mesh=False)
        work = worker_half(engine, kv.caches, BLOCK, saves_off_forward=False)
        if agree:
            work.worker_side.agreement = CollectiveAgreement([dist.group.WORLD])
        oracle = ContextForward(kv, list(range(20, 32)))
        tokens = random_tokens(TOKENS, seed=71).tolist()
        first = [1, 2, 3, 4]
        oracle.run(tokens, first, 0, 2 * CHUNK)
        token_api.store(engine, tokens[:2 * CHUNK], kv_caches=kv.caches,
                        slot_mapping=oracle._slots(first, 0, 2 * CHUNK))
        if rank == 0:
            assert engine.cpu.remove(engine.hasher.spans(tokens)[1].key)
        chain = ChunkHasher(KeyParams("test-model", engine.key_params.kv_format), CHUNK).chain(tokens)
        blocks = [10, 11, 12, 13, 14, 15, 16, 17]
        step = KVMeshConnectorMetadata(requests=[ReqMeta(
            "r", [span.key for span in chain], blocks, load=LoadSpec(end=2 * CHUNK, need=2 * CHUNK, mask_start=0,
                                                                      skip_prefix=0),
            save=SaveSpec(end=TOKENS, mask_start=2 * CHUNK))])

        def forward(layer: int, name: str) -> None:
            if layer == 0:
                oracle.run(tokens, blocks, 2 * CHUNK, TOKENS)
        result = run_worker_step(work, step, set(), forward)
        results.put((rank, sorted(result.load_errors), token_api.lookup(engine, tokens, search_range=[LOCAL_CPU])))
        engine.close()
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path: Path, agree: bool) -> dict[int, tuple[list[int], int]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_file = str(tmp_path / f"init-{agree}")
    ranks = [context.Process(target=rank_step, args=(rank, init_file, agree, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        found = [results.get(timeout=WAIT_S * 4) for _ in ranks]
    finally:
        for process in ranks:
            process.join(WAIT_S)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in ranks), [process.exitcode for process in ranks]
    return {rank: (errors, held) for rank, errors, held in found}


def test_a_load_that_failed_on_one_rank_is_saved_by_no_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", HELPERS_PATH)
    by_rank = run_two_ranks(tmp_path, agree=True)
    # tokens 32..64 (blocks 12 and 13) were not loaded on rank 0: both ranks report them and the blocks computed
    # over them (14..17), neither stores chunks 2 and 3
    assert by_rank[0] == ([12, 13, 14, 15, 16, 17], 32)
    assert by_rank[1] == ([12, 13, 14, 15, 16, 17], 2 * 32)


def test_without_agreement_the_other_rank_stores_kv_computed_over_the_failed_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the agreement prevents (the test above would fail without it)."""
    monkeypatch.setenv("PYTHONPATH", HELPERS_PATH)
    by_rank = run_two_ranks(tmp_path, agree=False)
    assert by_rank[0] == ([12, 13, 14, 15, 16, 17], 32)
    assert by_rank[1] == ([], TOKENS), "rank 1 stored its shard of the chunks computed over rank 0's failed load"
