"""KVMesh's own package under every service (imported as `kvmesh.shared`): it imports nothing of services/
(tests/engine/test_layering.py). The engine's own configuration is services/engine/config/.

    wire/                what crosses between processes as bytes or names: keys, chunk file, data paths, Redis layout
    protocol/            every NATS message and subject
    messaging/           NATS plumbing: the bus, credentials, permissions, sharing domains, admission reports
    store_kit/           what every chunk store is built from (server side: the engine imports none of it)
    ops/                 running the mesh's processes: services, the HTTP gate, the local mesh, its supervisor
    eviction/            eviction policies with pins (the CPU tier and both stores)
    tls.py               TLS across hosts: a small CA, per-service certificates, server and client contexts
    errors.py            the one exception hierarchy
    aio.py               small asyncio helpers
    rate_limited_log.py  a logger's warnings at most once per interval per cause
    processes.py         small facts about other processes (is a pid alive)
    options_cli.py       command-line flags generated from an options dataclass; `GB`, the unit sizes are given in
"""
