"""P2P hits: which live engine worker of another instance holds the longest prefix of some chunk keys in its CPU
tier (`PeerLookup`, one request per lookup that the asker's own tiers missed).

The keys are the asker's shard keys: they already name the model, KV format, tensor-parallel rank and sharing
domain (shared/keys.py), so any worker holding them holds chunks the asker can load, rank for rank. The answer
is limited to live workers that serve peers (`enable_p2p`) in the asker's sharing domain (each worker's
principal's in the domains map, never what its registration says); it is a hint, not a permission: the asker
then asks that worker for a stream over NATS, which lets engines publish only to peers of their own domain
(shared/nats_permissions.py).
"""

from __future__ import annotations

from typing import Sequence

from kvmesh.shared import protocol
from kvmesh.services.controller.producers import Producer, ProducerTable


def peer_holder(table: ProducerTable, asker: Producer, keys: Sequence[bytes]) -> protocol.PeerLookupReply:
    """The live worker (of another instance, in `asker`'s domain) whose CPU tier holds the most leading `keys`."""
    reg = asker.engine
    if reg is None or not keys:
        return protocol.PeerLookupReply()
    peers = {producer.slot: producer for producer in table.producers.values()
             if producer.alive and producer.engine is not None and producer.engine.p2p
             and producer.engine.instance_id != reg.instance_id and producer.domain == asker.domain}
    candidates = sum(1 << slot for slot in peers)
    get = table.index.table.get
    held = 0
    for key in keys:
        holders = candidates & get(key, 0)
        if not holders:
            break
        candidates, held = holders, held + 1
    if not held:
        return protocol.PeerLookupReply()
    peer = peers[(candidates & -candidates).bit_length() - 1]  # the lowest slot among those holding the most
    assert peer.engine is not None
    return protocol.PeerLookupReply(instance_id=peer.engine.instance_id, worker_id=peer.producer_id,
                                    num_chunks=held)
