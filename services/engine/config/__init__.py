"""The engine's own configuration, read by every floor above it; no store or controller reads it.

    engine_config.py  `EngineConfig`: LMCache's keys plus ours, from YAML, env vars and vLLM's extra config
    lmcache_keys.py   every key of LMCache's configuration, and what KVMesh does with it
    engine_auth.py    the engine's NATS credentials from its config keys
"""
