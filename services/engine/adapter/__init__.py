"""The vLLM side of the engine: the connector's two halves, what they keep per request and how the scheduler
learns what is cached.

    scheduler_side.py    the connector's scheduler half (vLLM's EngineCore): lookups, per-step load/save plans
    worker_side.py       the connector's worker half (each vLLM worker): vLLM's calls, turned into loads and saves
    request_load.py      one request's load in a step (spans, slots, state, failures, rank agreement)
    saves.py             each step's saves after the forward, none past a failed load's first wrong token
    request_slots.py     where a request's KV sits in vLLM's paged cache (token slots, a state's span and slots)
    request_meta.py      the scheduler -> worker metadata of each step (loads, saves) and the per-request tracker
    request_extras.py    what besides the token ids a request's KV depends on (LoRA, cache_salt, images, embeds)
    request_retention.py a request's kv_priority, lease and load / store tiers from its kv_transfer_params
    model_identity.py    the model part of chunk keys (revision, quantization, RoPE, ...), the same on every rank
    scheduler_lookup.py  the scheduler's answer to "how much of this prompt is cached"
    cpu_mirror.py        the scheduler's mirror of each worker's CPU tier, and evictions held until it saw them
    block_prefix.py      hits that end inside a chunk, at a vLLM block boundary
    kv_groups.py         vLLM's KV cache groups (hybrid models) as KVMesh caches them
    vllm_blocks.py       vLLM's KV cache manager as the scheduler half reads it (block tables, failed loads)
    async_loads.py       loads that run between vLLM's steps (enable_async_loading)
    cpu_leases.py        CPU-tier chunks leased at lookup, so a hit with KV cache groups loads in-step
    in_step_loads.py     which hits with KV cache groups load in-step (leased, or promised from the mirror)
    async_saves.py       saves off the forward's critical path, and what preemption and request ends wait for
    load_agreement.py    the ranks of one replica agree on how far each load brought the tokens' KV
    pd.py                prefill/decode disaggregation over P2P: the producer's hand-over, the consumer's hint
    kv_events.py         the CPU tier's admissions and evictions as vLLM's KV events, for routers
    connector_stats.py   the connector's metrics on vLLM's /metrics, named as LMCache names them
"""
