"""A KV oracle for load and save tests: each token's KV depends on its tokens *and* on the KV its earlier block
actually holds in vLLM's paged cache when the forward runs, as a transformer's does (attention reads the
earlier KV). One wrong block therefore shows up in every block computed after it, and a chunk stored from
such blocks differs from the oracle for its key.

`ContextForward` writes the KV of tokens [start, end) of a sequence into its blocks (vLLM's CPU layout, as
tests/test_engine_support.PagedKV makes it) and computes what they should hold (`expected_tokens`) in blocks
the test reserves for it.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from kvmesh.services.engine.core.kv_layout import cpu_token_views
from kvmesh.services.engine.core.paged_copy import gather

from test_engine_support import PagedKV


class ContextForward:
    """vLLM's forward over `kv` (CPU layout: each layer ``[num_blocks, heads, block_size, 2 * head_size]``).

    Token t's K and V in layer l are a pseudo-random function of (l, t, the tokens of its block up to t, the
    request's extras, a digest of the KV the previous block holds at that moment). `scratch` blocks are the
    oracle's own: `expected_tokens` recomputes a sequence there from nothing.
    """

    def __init__(self, kv: PagedKV, scratch: Sequence[int]) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.scratch = list(scratch)

    def _token_kv(self, layer: int, pos: int, tokens: Sequence[int], salt: str, previous: int,
                  like: torch.Tensor) -> torch.Tensor:
        start = pos - pos % self.block_size
        seed = zlib.crc32(f"{layer}/{pos}/{salt}/{previous}/{list(tokens[start:pos + 1])}".encode())
        return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype)

    @staticmethod
    def digest(block: torch.Tensor) -> int:
        return zlib.crc32(block.contiguous().view(torch.int16).numpy().tobytes())

    def run(self, tokens: Sequence[int], block_ids: Sequence[int], start: int, end: int, salt: str = "") -> None:
        """The forward computes tokens [start, end) of `tokens` into `block_ids`, reading the earlier blocks."""
        B = self.block_size
        for layer, cache in enumerate(self.kv.caches.values()):
            k, v = cpu_token_views(cache, self.kv.layout)  # [blocks, block_size, heads, head_size]
            for pos in range(start, end):
                block = pos // B
                previous = self.digest(cache[block_ids[block - 1]]) if block else 0
                kv = self._token_kv(layer, pos, tokens, salt, previous, k[0, :2])
                k[block_ids[block], pos % B] = kv[0]
                v[block_ids[block], pos % B] = kv[1]

    def expected_tokens(self, tokens: Sequence[int], salt: str = "") -> list[int]:
        """Compute `tokens` from nothing into the scratch blocks (their first blocks); those block ids."""
        blocks = self.scratch[: -(-len(tokens) // self.block_size)]
        assert len(blocks) * self.block_size >= len(tokens), "not enough scratch blocks"
        self.run(tokens, blocks, 0, len(tokens), salt)
        return blocks

    def holds(self, tokens: Sequence[int], block_ids: Sequence[int], end: int, salt: str = "",
              start: int = 0) -> bool:
        """Whether `block_ids` hold the oracle's KV for tokens [start, end) of `tokens`."""
        return torch.equal(self._tokens(block_ids, start, end), self._tokens(self.expected_tokens(tokens[:end], salt),
                                                                              start, end))

    def chunk_is(self, chunk: torch.Tensor, tokens: Sequence[int], start: int, end: int, salt: str = "") -> bool:
        """Whether `chunk` (a stored chunk of tokens [start, end), ``layout.chunk_shape``) is the oracle's."""
        blocks = self.expected_tokens(tokens[:end], salt)
        want = torch.empty_like(chunk)
        gather(self.kv.caches, self.kv.layout, self._slots(blocks, start, end), want)
        return torch.equal(self._chunk_tokens(chunk, end - start), self._chunk_tokens(want, end - start))

    def _chunk_tokens(self, chunk: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The K and V of a chunk's tokens: a per-block chunk also carries its last block's unused rows."""
        if not self.kv.layout.per_block:
            return chunk
        k, v = cpu_token_views(chunk, self.kv.layout)  # [layers, blocks, block_size, heads, head_size]
        return torch.stack([x.flatten(1, 2)[:, :num_tokens] for x in (k, v)])

    def _slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        B = self.block_size
        return torch.as_tensor([block_ids[p // B] * B + p % B for p in range(start, end)], dtype=torch.int64)

    def _tokens(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        return self.kv.token_kv(self._slots(block_ids, start, end))
