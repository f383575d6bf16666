"""The engine's infrastructure under every other floor: NATS, where it is, and the threads' CPUs.

    nats_loop.py      the engine's background asyncio thread and its NATS client
    embedded.py       where NATS is: join a configured mesh, or bring one up inside vLLM's process tree
    domain.py         the engine's sharing domain: which credentials file says it, what it mixes into keys
    side_cpus.py      the cores the engine's threads run on, off those vLLM binds its compute to
"""
