"""KVMesh controller: the LMCache controller REST API backed by an index of chunk holders built from NATS events.

One process, one asyncio event loop (main thread) runs everything:
  - `service.py`   lifecycle: embedded nats-server (unless a NATS URL is given), NATS client, uvicorn
  - `producer_feed.py`  NATS subscriptions (events, registrations, heartbeats, health), hello, sync requests
  - `producers.py` the producer table: registrations, per-producer sequence/sync state, liveness (pure logic)
  - `producer_records.py`  what the table keeps of one producer, a full sync being received, ingest counters
  - `instance_claims.py`  which workers claim an instance id and rank, and which one serves it
  - `principal_quotas.py`  what one principal's registrations and reported keys may cost (its shares)
  - `holder_index.py`  which producers hold which key: key -> bitmask of producer slots (pure data structure)
  - `kv_event_stream.py`  the fleet-wide KV event stream: the index's changes as vLLM's KV events over ZMQ (opt-in)
  - `lookup.py`    /lookup: per-instance hashing and contiguous-prefix crediting
  - `commands.py`  pin / unpin / clear forwarded to engine workers by NATS request/reply
  - `ops.py`       event ids for /check_finish
  - `core.py`      the operations, HTTP-free;  `api/` the FastAPI app;  `metrics.py` the counters /metrics shows
  - `config.py`    flags;  `__main__.py` the thin entry point (`lmcache_controller`)
"""
