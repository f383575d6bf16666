"""What every chunk store is built from, whatever holds its bytes (disk store, remote store). Server side: the
engine imports nothing of it (tests/engine/test_layering.py).

    chunk_index.py        a store's index: held chunks, puts in flight, eviction order, pins, token counts
    chunk_claims.py       who put each chunk, what a clear took back
    chunk_pins.py         who holds a store's pins, and how many each
    retention_restore.py  persisted retention read back as untrusted input, re-taken within each owner's share
    state_file.py         the pins and claims files beside a store's chunks
    store_ops.py          the ops every store answers the same way from its index
    store_endpoint.py     a store's presence on NATS: its subscriptions, one connection per sharing domain
    store_bounds.py       the bounds a NATS client can push on at a store, and their flags
"""
