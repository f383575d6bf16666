"""A cache engine in a process of its own, for tests whose engines run on other hosts (tests/support/netns.py):
run as `python tests/support/host_engine.py store|load CONFIG_JSON` (with tests/ on PYTHONPATH) inside a host.

Settings: {"tokens", "config" (EngineConfig keys), "tiers" (the locations below the CPU tier it waits to know
before it stores or loads)}. `store`: vLLM's forward (support.kv_oracle.ContextForward) over the prompt into its paged KV, then the engine
stores it; once every chunk reached every store it goes to (write-behind done), it prints one JSON line
({"stored": tokens, "needles": hex slices of the KV bytes it stored, for a sniffer}) and serves (its CPU tier to
peers, with P2P) until its stdin closes. `load`: a lookup, then a load into fresh blocks; prints {"loaded":
tokens, "oracle": whether every block holds what the forward computes, "fetched": the engine's per-tier fetch
counts, "errors": its load errors}, and exits.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.shared.wire.keys import KeyParams

from support.engine import PagedKV, engine_config, random_tokens
from support.kv_oracle import ContextForward
from support.waiting import WAIT_S, wait_until

BLOCKS = 64
SCRATCH = list(range(BLOCKS - 16, BLOCKS))
NEEDLE_BYTES = 32


def slots_of(blocks: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    return torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(num_tokens)])


def needles(kv: PagedKV, blocks: list[int], count: int = 8) -> list[str]:
    """Slices of the KV bytes the engine stores (its blocks, copied whole into chunks), spread over them."""
    raw = kv.buffer[:, blocks].contiguous().view(torch.uint8).numpy().tobytes()
    step = len(raw) // count
    return [raw[i * step:i * step + NEEDLE_BYTES].hex() for i in range(count)]


def main(mode: str, settings: dict[str, Any]) -> None:
    tokens = random_tokens(settings["tokens"], seed=settings.get("seed", 7)).tolist()
    kv = PagedKV(num_blocks=BLOCKS, seed=settings.get("kv_seed", 1))
    engine = build_engine(engine_config(**settings["config"]), KeyParams(model="test-model", kv_format=""),
                          kv.layout)
    try:
        if not engine.wait_connected(WAIT_S):
            raise RuntimeError("the engine did not reach NATS")
        for location in settings.get("tiers", []):  # the stores and peers it must know before it stores or loads
            wait_until(lambda: engine.storage.lower(location) is not None, what=f"the engine's {location} tier")
        if settings["config"].get("enable_p2p"):
            wait_until(lambda: engine.mesh.agent.started, what="the engine's P2P server")
        blocks = list(range(-(-len(tokens) // kv.block_size)))
        if mode == "store":
            ContextForward(kv, SCRATCH).run(tokens, blocks, 0, len(tokens))
            slots = slots_of(blocks, len(tokens), kv.block_size)
            token_api.store(engine, torch.tensor(tokens), **kv.kv(slots))
            chunks = -(-len(tokens) // engine.config.chunk_size)  # each put by every store it goes to
            wait_until(lambda: engine.storage.stats.get("write_behind_done", 0) >= chunks,
                       what=f"{chunks} chunks written to the stores")
            print(json.dumps({"stored": len(tokens), "needles": needles(kv, blocks)}), flush=True)
            sys.stdin.read()  # serve until the test closes our stdin
        else:
            blocks = [b + 8 for b in blocks]
            wait_until(lambda: token_api.lookup(engine, tokens) == len(tokens), what="the prompt found")
            mask = token_api.retrieve(engine, torch.tensor(tokens), **kv.kv(slots_of(blocks, len(tokens),
                                                                                     kv.block_size)))
            stats = engine.storage.stats
            print(json.dumps({"loaded": int(mask.sum()),
                              "oracle": ContextForward(kv, SCRATCH).holds(tokens, blocks, len(tokens)),
                              "fetched": {k: v for k, v in stats.items() if k.startswith("fetched_")},
                              "errors": {k: v for k, v in stats.items() if "failed" in k or "error" in k}}),
                  flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
