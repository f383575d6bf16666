"""The remote store (LMCache's `RemoteBackend`): one chunk store shared by many engines on many hosts.

One process per key partition (`python -m kvmesh.services.remote_store`); engines reach all of them through
`RemoteStoreClient` (services/engine/tiers/remote.py). Modules, from the wire inwards:
    __main__.py     flags, logging, NATS connect, run until SIGTERM
    service.py      NATS handlers (control ops, stream negotiation, health, admission events)
    stream_server.py  the store end of the bulk data path: TCP streams with single-use tickets (the wire format,
                    shared with the engine's end services/engine/tiers/remote_stream.py: shared/wire/stream_wire.py)
    options.py      flags, both ways (read, and written for whoever starts a store)
    store.py        chunks in memory: ChunkIndex (LRU under the cap, pins) over recycled buffers
    buffers.py      page-faulted buffers, recycled by size class
    persistence.py  optional write-behind mirror of the memory in chunk files (shared/wire/chunk_file.py)
Which replica owns a key: shared/wire/partition.py (the clients compute it alike).
"""
