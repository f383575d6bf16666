"""Helpers for the engine tests (random paged KV caches in vLLM's CPU layout, slot mappings, configs).

The caches mimic what vLLM 0.32's CPU backend registers: one buffer, every layer a contiguous
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view (LBHNC), blocks copied whole by the engine.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.kv_layout import KVLayout, cpu_token_views, detect_layout
from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.protocol import disk_store_id

from support.waiting import WAIT_S

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 2, 2, 32, 16, 96
CHUNK = 32  # two blocks per chunk


class PagedKV:
    """A random paged KV cache: `caches` (dict of per-layer views of `buffer`) and its `layout`."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, seed: int = 0, layers: int = LAYERS, heads: int = HEADS,
                 head_size: int = HEAD_SIZE, block_size: int = BLOCK, dtype: torch.dtype = torch.bfloat16) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (layers, num_blocks, heads, block_size, 2 * head_size)
        self.buffer = torch.randn(shape, generator=self.gen).to(dtype)
        self.caches = {f"model.layers.{i}.self_attn": self.buffer[i] for i in range(layers)}
        self.layout: KVLayout = detect_layout(self.caches, block_size, "CPU_ATTN", cpu_isa="vec")

    def slots(self, num_tokens: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """A random block-structured slot mapping: distinct random blocks, consecutive slots inside a block."""
        blocks_needed = -(-num_tokens // self.block_size)
        order = torch.randperm(self.num_blocks, generator=self.gen)
        if exclude is not None:
            used = set((exclude[exclude >= 0] // self.block_size).tolist())
            order = torch.tensor([b for b in order.tolist() if b not in used], dtype=torch.int64)
        blocks = order[:blocks_needed]
        assert len(blocks) == blocks_needed, "not enough free blocks"
        offsets = torch.arange(self.block_size).repeat(blocks_needed)
        return (blocks.repeat_interleave(self.block_size) * self.block_size + offsets)[:num_tokens]

    def token_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """K and V of the tokens at `slots`: ``[layers, 2, tokens, heads, head_size]`` (a copy)."""
        out = []
        for cache in self.caches.values():
            k, v = cpu_token_views(cache, self.layout)  # [nb, N, H, D]
            flat_k = k.reshape(-1, k.shape[2], k.shape[3])
            flat_v = v.reshape(-1, v.shape[2], v.shape[3])
            out.append(torch.stack([flat_k[slots], flat_v[slots]]))
        return torch.stack(out)

    def kv(self, slots: torch.Tensor) -> dict[str, object]:
        return {"kv_caches": self.caches, "slot_mapping": slots}


def engine_config(**overrides: object) -> EngineConfig:
    """Small settings: 32-token chunks, a CPU pool of `cpu_chunks` chunks (default 64). The request and blocking
    timeouts are generous (a store on a loaded machine still answers in time); a test of a timeout sets its own."""
    cpu_chunks = int(overrides.pop("cpu_chunks", 64))  # type: ignore[arg-type]
    chunk_nbytes = LAYERS * 2 * HEADS * BLOCK * 2 * HEAD_SIZE * 2  # 2 blocks per chunk, bf16
    defaults: dict[str, object] = {
        "chunk_size": CHUNK, "max_local_cpu_size": (cpu_chunks * _aligned(chunk_nbytes) + 100) / 1024**3,
        "request_timeout_secs": WAIT_S / 3, "blocking_timeout_secs": WAIT_S, "heartbeat_interval_secs": 0.5,
    }
    defaults.update(overrides)
    return EngineConfig(**defaults)  # type: ignore[arg-type]


def _aligned(nbytes: int) -> int:
    return (nbytes + 4095) // 4096 * 4096


@contextlib.contextmanager
def disk_store_mesh(directory: Path, max_size_gb: float = 0.05) -> Iterator[LocalMesh]:
    """NATS plus a real disk store process (the module `kvmesh up` runs) keeping its files in `directory`."""
    store_id = disk_store_id()
    spec = ServiceSpec("kvmesh.services.disk_store", ["--dir", str(directory), "--max-size-gb", str(max_size_gb),
                                                      "--store-id", store_id], store_id)
    mesh = LocalMesh([spec]).start(ready_timeout=WAIT_S)
    try:
        yield mesh
    finally:
        mesh.stop()


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed))
