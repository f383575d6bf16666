"""The disk store (`LocalDiskBackend`): one service per host keeping chunks as crash-safe files.

Modules: `store` (put, over a shared ChunkIndex), `reader` (get and cancel_get), `index` (the disk's chunk
entry, the key check), `snapshot` (the index snapshot a restart reads), `files` (directory lock), `writer`
(staging buffers and writer threads), `service` (NATS wiring, with the control ops shared with the remote
store), `pools` (the store's pool socket and lent pools), `options` and `__main__` (CLI). Also used: shared/wire/shm.py (the engines' sealed pools), shared/wire/pool_wire.py (how
an engine lends its pool: what both sides share); shared with the remote store: shared/store_kit/chunk_index.py,
shared/wire/chunk_file.py (files, start-up scan), shared/store_kit/store_ops.py and shared/store_kit/store_endpoint.py.
The engine's client of this store (`DiskStoreClient`) and its side of pool lending are services/engine/tiers/disk.py and
pool_lending.py.
"""
