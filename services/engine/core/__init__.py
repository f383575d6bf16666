"""The cache core: moving chunks between vLLM's paged KV cache and the tiers.

    cache_engine.py      one worker's engine: the connector's chunk API (one load entry, one save entry)
    chunk_load.py        a load's chunks on their way into vLLM's paged cache (scatter, or layer by layer)
    token_api.py         LMCache's cache engine API by tokens (store / retrieve / lookup / prefetch / pin ...)
    storage_manager.py   the tier walk: lookups, fetches and prefetches across the tiers
    write_behind.py      the write-behind to the lower tiers, and the known-held set it leaves
    tier_commands.py     the controller's commands on the tiers: pin / unpin / clear / lookup, move, evict
    recency.py           hits in any tier refresh the chunks' recency in the stores (batched touches)
    slot_quarantine.py   pool slots a store may still write into, held out of use until it settles them
    kv_layout.py         how vLLM pages its KV cache, and the chunk format it is copied into
    paged_copy.py        gather / scatter between the paged cache and a chunk: `PagedCopier` picks the path
    paged_torch.py       the torch path (any device; the oracle of the kernels)
    paged_kernels.py     the CuPy path on CUDA: paged_copy_kernels.cu compiled per device, and its launches
    paged_geometry.py    what both paths share: slot and chunk checks, the layers' views grouped for one copy
    layerwise_load.py    loads copied layer by layer on a side CUDA stream (use_layerwise)
    layer_pipeline.py    CPU: loads written layer by layer on a thread beside the forward (cpu_load_pipeline)
"""
