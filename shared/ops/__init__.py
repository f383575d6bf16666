"""Running the mesh's processes: a service's life, its HTTP front, and the mesh on one machine.

    service.py         a service process: health answers, signals, a clean stop, `service_main`
    http_gate.py       `BodyGate`: what an HTTP server (controller, pd-proxy) does to a request first
    local_mesh.py      an embedded NATS plus service processes, started and stopped together
    store_commands.py  the command lines that start this host's stores (`kvmesh up`, the engine's embedded mesh)
    supervisor.py      restarts a LocalMesh's services that exit, with a backoff (`kvmesh up`)
"""
