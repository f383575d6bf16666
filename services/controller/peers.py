"""P2P hits: which live engine workers of other instances serve some chunk keys from their CPU tiers (`PeerLookup`,
one request per lookup that the asker's own tiers missed).

The keys are the asker's shard keys: they already name the model, KV format, tensor-parallel rank and sharing
domain (shared/wire/keys.py), so any worker holding them holds chunks the asker can load, rank for rank. The answer
is limited to live workers that serve peers (`enable_p2p`) in the asker's sharing domain, which is each worker's
principal's in the domains map (never what a registration says); it is a hint, not a permission: the asker then
asks those workers for streams over NATS, which lets engines publish only to peers of their own domain
(shared/messaging/nats_permissions.py).

Who serves a key is its *holder of record*: of the candidates holding it, the one whose admission of it the
controller applied first (`HolderIndex.first_of`), as a store keeps its first writer's bytes. Not the one holding
the most keys, not the lowest slot, not anyone a message names: a member that claims keys it does not hold, or
holds other bytes under them, serves them only where no candidate admitted them before it (the pre-plant
residual, docs/security.md). The answer is runs of consecutive keys with one holder of record each, up to the
first key no candidate holds. Workers the asker excludes (their chunks of this chain failed its check) are not
candidates.
"""

from __future__ import annotations

from kvmesh.services.controller.producer_records import Producer
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.shared import protocol

MAX_EXCLUDED = 64  # workers one lookup may exclude (more are ignored: the list is the asker's input)


def peer_holders(table: ProducerTable, asker: Producer, request: protocol.PeerLookup) -> protocol.PeerLookupReply:
    """The holders of record of `request.keys`' leading run of keys, among the live P2P workers of other
    instances in `asker`'s sharing domain."""
    reg = asker.engine
    if reg is None:
        return protocol.PeerLookupReply()
    peers = {producer.slot: producer for producer in table.producers.values()
             if producer.alive and producer.engine is not None and producer.engine.p2p
             and producer.engine.instance_id != reg.instance_id and producer.domain == asker.domain}
    excluded = set(request.exclude[:MAX_EXCLUDED])
    peers = {slot: peer for slot, peer in peers.items() if peer.producer_id not in excluded}
    producer_live = any(peer.producer_id == request.producer for peer in peers.values())
    candidates = sum(1 << slot for slot in peers)
    runs: list[list[int]] = []  # [slot, keys]
    first_of = table.index.first_of
    for key in request.keys if candidates else ():
        slot = first_of(key, candidates)
        if slot is None:
            break
        if runs and runs[-1][0] == slot:
            runs[-1][1] += 1
        else:
            runs.append([slot, 1])
    named = [(peers[slot].engine.instance_id, peers[slot].producer_id, count)  # type: ignore[union-attr]
             for slot, count in runs]
    if not named:
        return protocol.PeerLookupReply(producer_live=producer_live)
    (instance_id, worker_id, count), more = named[0], named[1:]
    return protocol.PeerLookupReply(instance_id=instance_id, worker_id=worker_id, num_chunks=count,
                                    more_instances=[run[0] for run in more], more_workers=[run[1] for run in more],
                                    more_chunks=[run[2] for run in more], producer_live=producer_live)
