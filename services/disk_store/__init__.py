"""The disk store (`LocalDiskBackend`): one service per host keeping chunks as crash-safe files.

Modules: `store` (put and get, over a shared ChunkIndex), `index` (the disk's chunk entry and persisted
pins), `files` (directory lock, pins file), `writer` (staging buffers and writer threads), `service` (NATS wiring,
with the control ops shared with the remote store), `client` (the engine's StoreTier), `options` and
`__main__` (CLI). Shared with the remote store: shared/chunk_index.py, shared/chunk_file.py (files, start-up
scan), shared/shm.py (attached shared-memory segments), shared/store_service.py.
"""
