"""The worker's services on the mesh, standing on the cache core (services/engine/core/).

    worker_agent.py   one worker's presence on the mesh: registration, admission events, controller commands
    lookup_server.py  the worker's answer to the scheduler's lower-tier lookups
    peer_server.py    the worker's CPU tier served to its peers (P2P)
    rendezvous.py     the file each worker publishes so that its scheduler finds it
"""
