"""A KV oracle for load and save tests: each token's KV depends on its tokens *and* on the KV its earlier block
actually holds in vLLM's paged cache when the forward runs, as a transformer's does (attention reads the
earlier KV). One wrong block therefore shows up in every block computed after it, and a chunk stored from
such blocks differs from the oracle for its key.

`ContextForward` writes the KV of tokens [start, end) of a sequence into its blocks (vLLM's CPU layout, as
support.engine.PagedKV makes it) and computes what they should hold (`expected_tokens`) in blocks
the test reserves for it. `Forward` is the simpler oracle: a block's KV depends only on its request and its
place in the sequence.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from kvmesh.services.engine.core.kv_layout import cpu_token_views
from kvmesh.services.engine.core.paged_torch import gather

from support.engine import PagedKV


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


class Forward:
    """Stands for vLLM's forward: writes each computed block of a request with KV that depends only on the
    request and the block's place in its sequence, so any chunk can be checked against what it must hold."""

    def __init__(self, kv: PagedKV) -> None:
        self.kv = kv
        self._pending: tuple[str, list[int], int, int] = ("", [], 0, 0)

    @staticmethod
    def pattern(req_id: str, logical: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{req_id}/{logical}".encode()))
        return torch.randn(shape, generator=gen).to(dtype)

    def compute(self, req_id: str, block_ids: list[int], first: int, count: int) -> None:
        """The next forward computes logical blocks [first, first + count) of `req_id` into `block_ids`."""
        self._pending = (req_id, block_ids, first, count)

    def __call__(self, layer: int, name: str) -> None:
        req_id, block_ids, first, count = self._pending
        cache = self.kv.caches[name]
        for logical in range(first, first + count):
            cache[block_ids[logical]] = self._layer_pattern(req_id, logical, layer, cache)

    def _layer_pattern(self, req_id: str, logical: int, layer: int, cache: torch.Tensor) -> torch.Tensor:
        return self.pattern(f"{req_id}/L{layer}", logical, cache[0].shape, cache.dtype)

    def expected(self, req_id: str, logical: int) -> list[torch.Tensor]:
        """What block `logical` of `req_id` holds in each layer."""
        return [self._layer_pattern(req_id, logical, i, cache) for i, cache in enumerate(self.kv.caches.values())]

    def holds(self, req_id: str, block_ids: list[int], logical_blocks: range) -> bool:
        return all(torch.equal(cache[block_ids[logical]], want[i])
                   for logical in logical_blocks
                   for want in [self.expected(req_id, logical)]
                   for i, cache in enumerate(self.kv.caches.values()))
