"""The vLLM side of the engine: what the connector keeps per request and how the scheduler learns what is cached.

    request_meta.py      the scheduler -> worker metadata of each step (loads, saves) and the per-request tracker
    request_extras.py    what besides the token ids a request's KV depends on (LoRA, cache_salt, images, embeds)
    scheduler_lookup.py  the scheduler's answer to "how much of this prompt is cached"
"""
