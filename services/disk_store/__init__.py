"""The disk store (`LocalDiskBackend`): one service per host keeping chunks as crash-safe files.

Modules: `index` (held/pending keys, LRU, pins; pure), `files` (directory lock, start-up scan, deletions, pins
file), `writer` (staging buffers and writer threads), `shm` (attached shared-memory segments), `store` (the
operations), `service` (NATS wiring), `client` (the engine's ChunkStoreClient), `options` and `__main__` (CLI).
"""
