"""The engine's side of the mesh (NATS plus the KVMesh services).

    nats_loop.py      the engine's background asyncio thread and its NATS client
    embedded.py       where NATS is: join a configured mesh, or bring one up inside vLLM's process tree
    worker_agent.py   one worker's presence on the mesh: registration, admission events, controller commands
    lookup_server.py  the worker's answer to the scheduler's lower-tier lookups
    rendezvous.py     the file each worker publishes so that its scheduler finds it
"""
