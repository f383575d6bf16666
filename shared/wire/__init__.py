"""What crosses between processes as bytes or names: chunk keys, the chunk file, the bulk data paths (shared memory
on one host, TCP streams across hosts), the Redis tier's layout and
the sealing of what is encrypted at rest. The NATS messages are shared/protocol/.

    keys.py           chunk keys: token sequences cut into chunks, each named by a prefix hash
    chunk_file.py     the self-describing chunk file (header, checksum), one per chunk in every store
    partition.py      which remote-store replica owns a chunk key
    shm.py            sealed anonymous shared memory between processes on one host
    pool_wire.py      how an engine lends its CPU pool to the disk store of its host
    stream_wire.py    the TCP stream data path's wire format: frames and socket reads/writes for both ends
    stream_server.py  the serving end of that stream (the remote store's and an engine's peer server)
    tls_socket.py     encryption on that stream's sockets: a TLS handshake, then AES-256-GCM frames keyed inside it
    aead.py           AES-256-GCM sealing of what is encrypted at rest (Redis values, the stores' chunks)
    redis_keys.py     KVMesh's key names in Redis / Valkey and how their values and entries are authenticated
    redis_url.py      the `remote_url` forms that address Redis or Valkey, and the client each needs
    kv_events.py      vLLM's KV event wire format (KVEventBatch) without vLLM, and the block hash of a chunk key
"""
