"""The disk store (`LocalDiskBackend`): one service per host keeping chunks as crash-safe files.

Modules: `store` (put and get, over a shared ChunkIndex), `index` (the disk's chunk entry and persisted
pins), `files` (directory lock, pins file), `writer` (staging buffers and writer threads), `service` (NATS wiring,
with the control ops shared with the remote store), `client` (the engine's StoreTier), `pool_socket` (how an
engine lends its pool to the store: the engine's side), `pools` (the store's pool socket and lent pools),
`options` and `__main__` (CLI). Also used: shared/shm.py (the engines' sealed pools); shared with the remote
store: shared/chunk_index.py, shared/chunk_file.py (files, start-up scan), shared/store_service.py.
"""
