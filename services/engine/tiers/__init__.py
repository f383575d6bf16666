"""Every tier the engine reaches, walked in this order by the storage manager:

    base.py           what every tier answers (`Tier`), and the data part of a store's client (`StoreTier`)
    cpu.py            the engine's own tier: chunks resident in its memory pool (`LocalCPUBackend`)
    memory_pool.py    that pool: the chunk slots every tier copy goes through (shared memory, reference counted)
    fault_ahead.py    its pages faulted in by a thread of its own ahead of the slabs it carves (not on vLLM's thread)
    disk.py           the disk store of the host (`DiskStoreClient`), over NATS
    pool_lending.py   how the disk client lends the pool to its store (the engine's side; shared/wire/pool_wire.py)
    remote.py         the remote store (`RemoteStoreClient`), over every partition
    remote_stream.py  its bulk data path: kept TCP streams (the client end; shared/wire/stream_wire.py)
    sealed.py         the disk and remote stores' chunks sealed on the engine (`SealedTier`, encrypt_stores)
    redis.py          or instead of the remote store, Redis / Valkey itself (`RedisTier`)
    redis_values.py   its values: their format, checked on every read, and the key that MACs them (`resolve_auth`)
    redis_scripts.py  its Lua scripts: each changes one chunk's keys atomically on the server
    redis_retention.py  a request's lease or priority as its chunks' TTL (volatile-ttl), within a share per principal
    redis_policy.py   what the server's eviction settings, checked at start, mean for pins, retention and puts
    peer.py           other instances' CPU tiers, the last tier of the walk (`PeerTier`, enable_p2p)
    registry.py       the lower tiers in walk order, one registry (`LOWER_TIERS`), built from the config
"""
