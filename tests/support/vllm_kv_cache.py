"""vLLM's own KV cache manager for a hybrid model, built as vLLM's engine core builds it, so that a test's block
tables are laid out exactly as vLLM lays them out (its MambaManager's align mode and prefill checkpoint block,
its sliding-window frees, fine-grained hash blocks, EAGLE's block drop) rather than by a model of it.

`hybrid_cache(groups, ...)` gives the `KVCacheConfig` (with the hash block size and cache-hit alignment the
engine core resolves into it, which the connector reads) and the scheduler's `KVCacheManager`; `request(...)`
a vLLM `Request` hashed as the scheduler hashes it; `tables(...)` a request's block ids per group with vLLM's
null block as -1 (what the connector's scheduler half reads after `bind_kv_cache_manager`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

DTYPE = torch.bfloat16


def full_attention(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=DTYPE)


def sliding_window(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=DTYPE, sliding_window=window)


def mamba2(block_size: int) -> MambaSpec:
    """A Mamba2 group in align mode, with the prefill checkpoint block vLLM's Mamba2 mixer asks for."""
    return MambaSpec(block_size=block_size, shapes=((2, 2 * block_size * 32),), dtypes=(DTYPE,),
                     mamba_cache_mode="align", num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)


@dataclass(frozen=True)
class VLLMCache:
    """The KV cache config and the scheduler's KV cache manager of one hybrid model."""

    config: KVCacheConfig
    manager: KVCacheManager
    block_size: int
    hash_block_size: int
    drop_eagle_block: bool


def hybrid_cache(groups: Sequence[tuple[str, Any]], num_blocks: int, block_size: int, hash_block_size: int,
                 drop_eagle_block: bool = False, max_model_len: int = 512) -> VLLMCache:
    """vLLM's KV cache for `groups` ((layer name, spec), one layer per group, in vLLM's group order)."""
    init_none_hash(sha256)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in groups])
    manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                             hash_block_size=hash_block_size, enable_caching=True, use_eagle=drop_eagle_block)
    # the engine core resolves both into every KVCacheConfig (vllm/v1/engine/core.py): hits land on hash blocks
    # when the manager allows fine-grained partial hits, else on whole blocks
    alignment = hash_block_size if manager.coordinator.enable_partial_hash_hits else block_size
    config.hash_block_size, config.cache_hit_alignment_tokens = hash_block_size, alignment
    return VLLMCache(config, manager, block_size, hash_block_size, drop_eagle_block)


def request(cache: VLLMCache, req_id: str, tokens: list[int]) -> Request:
    """A vLLM request, its block hashes computed as vLLM's scheduler computes them."""
    return Request(req_id, tokens, SamplingParams(max_tokens=8), None,
                   block_hasher=get_request_block_hasher(cache.hash_block_size, sha256))


def tables(cache: VLLMCache, req_id: str) -> list[list[int]]:
    """The request's block ids per group, vLLM's null block as -1."""
    null = cache.manager.block_pool.null_block.block_id
    return [[-1 if block == null else block for block in group] for group in cache.manager.get_block_ids(req_id)]
