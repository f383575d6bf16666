"""vLLM as the seeded simulation runs it: its own configs, `KVCacheConfig`s, `Scheduler` and KV cache manager,
and the connector's two halves created and attached where vLLM creates and attaches them.

What EngineCore does at start-up, in its order (vllm/v1/engine/core.py `_initialize_kv_caches`, `__init__`):
the layers' specs (sim_kinds.py) -> `resolve_kv_cache_layout` (the CPU attention backend's layouts) ->
`get_kv_cache_configs` (vLLM groups the layers, unifies their pages, sizes the pool) -> the scheduler's config,
block size, hash block size and cache-hit alignment -> `Scheduler(...)`, which creates the connector's scheduler
half through `KVConnectorFactory` and calls its `bind_kv_cache_manager`. Each worker (gpu_worker.py
`initialize_from_config`, gpu_model_runner.py `initialize_kv_cache`): its cache config takes the hash block size
and alignment, `KVConnectorFactory` creates the worker half, `allocate_kv_cache` builds the paged caches (one
buffer, the groups' layers sharing pages), `register_kv_caches` hands them to the connector.

Simulated tensor-parallel ranks live in this process: each gets its own copy of the config (`parallel_config.rank`,
which the connector reads for its rank when vLLM's process groups are not initialised) and its own caches, and
the ranks' load agreement is a `ThreadAgreement` (sim_ranks.py) installed before `register_kv_caches`.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from support.engine import BLOCK
from support.sim_kinds import GroupKind

MAX_MODEL_LEN = 320  # prompts of up to 7 chunks (224 tokens) and 40 generated tokens, with room for drafts
MAX_NUM_SEQS = 16


@functools.lru_cache(maxsize=None)
def model_dirs() -> tuple[Path, Path]:
    """A tiny Llama's config.json and an EAGLE draft's, for vLLM's ModelConfig (no weights, no tokenizer)."""
    import transformers

    root = Path(tempfile.mkdtemp(prefix="kvmesh-sim-model-"))
    for name, layers, arch in (("target", 2, "LlamaForCausalLM"), ("eagle", 1, "EagleLlamaForCausalLM")):
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                          max_position_embeddings=4096, torch_dtype="bfloat16")
        config.architectures = [arch]
        config.save_pretrained(root / name)
    return root / "target", root / "eagle"


@dataclass
class VllmSide:
    """vLLM's configs and scheduler for one schedule; the worker halves are made by `worker`."""

    kind: GroupKind
    vllm_config: Any
    kv_cache_configs: list[Any]  # one per rank (vLLM makes them all alike here)
    scheduler: Any  # vllm.v1.core.sched.scheduler.Scheduler, with the connector's scheduler half
    block_size: int
    hash_block_size: int
    block_hasher: Callable[[Any], list[Any]]  # what EngineCore gives each Request (get_request_block_hasher)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def worker(self, rank: int, agreement: Any = None) -> "Worker":
        """Rank `rank`'s worker half and its paged caches (a view per layer of one buffer), registered."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        config = copy.deepcopy(self.vllm_config)
        config.parallel_config.rank = rank
        kv_cache_config = self.kv_cache_configs[rank]
        config.cache_config.hash_block_size = kv_cache_config.hash_block_size
        config.cache_config.cache_hit_alignment_tokens = kv_cache_config.cache_hit_alignment_tokens
        connector = KVConnectorFactory.create_connector(config=config, role=KVConnectorRole.WORKER,
                                                        kv_cache_config=kv_cache_config)
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"),
                                   config.cache_config.get_resolved_kv_cache_layout(), None)
        connector.worker_side.agreement = agreement  # several ranks in one process: they meet on threads
        connector.register_kv_caches(caches)
        return Worker(connector, caches, config, kv_cache_config)


@dataclass
class Worker:
    """One rank's worker half, its registered caches, and its copies of vLLM's configs."""

    connector: Any
    caches: dict[str, torch.Tensor]
    vllm_config: Any
    kv_cache_config: Any


def build_vllm(kind: GroupKind, *, world_size: int, num_blocks: int, budget: int,
               engine_settings: Callable[[int], dict[str, object]]) -> VllmSide:
    """vLLM's side of a schedule. `engine_settings(page_bytes)` gives KVMesh's kv_connector_extra_config (it
    sizes the CPU tier in chunks, whose bytes depend on the pages vLLM chose)."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_kv_cache_configs,
                                             get_request_block_hasher, init_none_hash,
                                             resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    target, draft = model_dirs()
    model = ModelConfig(model=str(target), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    parallel = ParallelConfig(tensor_parallel_size=world_size)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=num_blocks,
                        mamba_cache_mode="align" if kind.has_state else "none",
                        prefix_match_unit=kind.hash_block_size)
    speculative = None
    if kind.spec_tokens:
        speculative = SpeculativeConfig(method="eagle", model=str(draft), num_speculative_tokens=kind.spec_tokens,
                                        target_model_config=model, target_parallel_config=parallel)
    transfer = KVTransferConfig(kv_connector="KVMeshConnector", kv_role="kv_both",
                                kv_connector_module_path="kvmesh.services.engine.connector")
    vllm_config = VllmConfig(
        model_config=model, cache_config=cache, parallel_config=parallel, device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=budget,
                                         max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                                         async_scheduling=False, is_encoder_decoder=False),
        kv_transfer_config=transfer, speculative_config=speculative)

    specs = kind.specs()
    layouts = [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]
    resolve_kv_cache_layout(vllm_config, [layouts] * world_size, list(specs.values()))
    memory = 1 << 30  # plenty for max_model_len: num_gpu_blocks_override sets the pool's size
    kv_cache_configs = get_kv_cache_configs(vllm_config, [specs] * world_size, [memory] * world_size)
    for config in kv_cache_configs:
        config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler_config = generate_scheduler_kv_cache_config(kv_cache_configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(scheduler_config, vllm_config, block_size, hash_block_size)
    for config in (*kv_cache_configs, scheduler_config):
        config.hash_block_size, config.cache_hit_alignment_tokens = hash_block_size, alignment

    page_bytes = kv_cache_configs[0].kv_cache_tensors[0].block_stride
    transfer.kv_connector_extra_config = engine_settings(page_bytes)
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=scheduler_config,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
                          hash_block_size=hash_block_size, log_stats=False)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return VllmSide(kind, vllm_config, kv_cache_configs, scheduler, block_size, hash_block_size,
                    get_request_block_hasher(hash_block_size, hash_fn))


__all__ = ["MAX_MODEL_LEN", "VllmSide", "Worker", "build_vllm", "model_dirs"]
