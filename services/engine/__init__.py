"""The engine: what runs inside vLLM. A facade (connector.py) over floors whose imports run one way only: a
module imports from its own floor and the floors below it, never from one above (tests/engine/test_layering.py).

Floors, bottom to top:

    config/        the engine's own configuration (`EngineConfig`, LMCache's keys, its NATS credentials)
    mesh/          infrastructure: the NATS loop thread, where NATS is, the sharing domain, the threads' CPUs
    tiers/         every tier the engine reaches: the CPU tier on its pool, the stores' clients, the peers
                   (handed what they need, store ids and credentials: they import nothing of mesh/ either)
    core/          the cache core: the engine, the tier walk, write-behind, tier commands, paged copies
    agents/        the worker's services on the mesh: worker agent, lookup server, peer server, rendezvous
    assembly.py    builds one worker's engine from the floors below (`build_engine`)
    adapter/       the connector's scheduler and worker halves: what speaks vLLM
    connector.py   `KVMeshConnector`, the class vLLM loads: hands each of vLLM's calls to its role's half
"""
