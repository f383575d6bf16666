"""The vLLM side of the engine: the connector's two halves, what they keep per request and how the scheduler
learns what is cached.

    scheduler_side.py    the connector's scheduler half (vLLM's EngineCore): lookups, per-step load/save plans
    worker_side.py       the connector's worker half (each vLLM worker): the cache engine, loads, saves
    request_meta.py      the scheduler -> worker metadata of each step (loads, saves) and the per-request tracker
    request_extras.py    what besides the token ids a request's KV depends on (LoRA, cache_salt, images, embeds)
    scheduler_lookup.py  the scheduler's answer to "how much of this prompt is cached"
"""
