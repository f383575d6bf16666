"""vLLM 0.32 alone (no connector, no model): the mis-key sim_miskey.py names, from its Scheduler and KV cache
manager's own outputs. Full attention + Mamba2 in align mode, block 16, prefix match unit 8 (the simulation's
mamba2-fine configs). A (46 tokens + 3 outputs) leaves the Mamba state after 40 tokens in vLLM's prefix cache and
full-attention blocks to 48; B (A's first 48 tokens + 29) hits 40 in Mamba, 48 in full attention, so vLLM copies
the 40-token state into a private block and computes [40, 77) in one step, which writes only columns 3 (checkpoint)
and 4 (running state). Strict xfail: vLLM keys that copy by B's 48-token hash; the test passes once it does not."""

from __future__ import annotations

import pytest

from support.sim_kinds import KINDS
from support.sim_vllm import model_dirs


def _scheduler():
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_kv_cache_configs,
                                             get_request_block_hasher, init_none_hash,
                                             resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    target, _ = model_dirs()
    config = VllmConfig(
        model_config=ModelConfig(model=str(target), skip_tokenizer_init=True, max_model_len=320),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True, num_gpu_blocks_override=40,
                                 mamba_cache_mode="align", prefix_match_unit=8),
        parallel_config=ParallelConfig(), device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=100, max_model_len=320,
                                         enable_chunked_prefill=True, async_scheduling=False,
                                         is_encoder_decoder=False))
    specs = KINDS["mamba2-fine"].specs()
    layouts = [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]
    resolve_kv_cache_layout(config, [layouts], list(specs.values()))
    kv_cache_config = generate_scheduler_kv_cache_config(get_kv_cache_configs(config, [specs], [1 << 30]))
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, config, block_size, hash_block_size)
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(config), block_size=block_size,
                          hash_block_size=hash_block_size, log_stats=False)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return scheduler, get_request_block_hasher(hash_block_size, hash_fn)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="vLLM 0.32 keys a partial Mamba hit's copy-on-write block by the next block boundary's hash "
                          "(tests/support/sim_miskey.py)")
def test_vllm_keys_a_mamba_copy_on_write_block_only_by_the_state_it_holds() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler, hasher = _scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    requests: dict[str, Request] = {}

    def add(req_id: str, tokens: list[int], max_tokens: int) -> Request:
        request = Request(request_id=req_id, prompt_token_ids=tokens, pooling_params=None, block_hasher=hasher,
                          sampling_params=SamplingParams(max_tokens=max_tokens))
        requests[req_id] = request
        scheduler.add_request(request)
        return request

    def step():
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        sampled = [[999] if requests[r].num_computed_tokens + output.num_scheduled_tokens[r] >= requests[r].num_tokens
                   else [] for r in ids]
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
        return output

    def mamba_block(request: Request, num_tokens: int) -> int | None:
        cached = pool.get_cached_block(request.block_hashes[num_tokens // 8 - 1], [1])
        return None if cached is None else cached[0].block_id

    a = add("A", list(range(1, 47)), 3)
    for _ in range(3):
        step()
    state_40 = mamba_block(a, 40)
    assert state_40 is not None
    b = add("B", list(a.all_token_ids)[:48] + list(range(500, 529)), 2)
    output = step()
    assert output.num_scheduled_tokens["B"] == 37 and b.num_computed_tokens == 77  # [40, 77) in one step
    copies = [copy.dst_block_id for copy in output.kv_cache_block_copies if copy.src_block_id == state_40]
    assert len(copies) == 1  # the private copy of the state after 40 tokens
    assert mamba_block(b, 48) != copies[0], "vLLM keyed the copy of the state after 40 by the 48-token hash"
