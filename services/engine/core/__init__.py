"""The cache core: moving chunks between vLLM's paged KV cache and the tiers.

    cache_engine.py      LMCache's cache engine API (store / retrieve / lookup / prefetch / pin / clear)
    storage_manager.py   the tier walk: lookups and fetches across the tiers, write-behind to the lower ones
    kv_layout.py         how vLLM pages its KV cache, and the chunk format it is copied into
    paged_copy.py        gather / scatter between the paged cache and a chunk (torch; CuPy kernels on CUDA)
"""
