"""Prefill/decode disaggregation over P2P: what a producer's `request_finished` hands the proxy, and what a
consumer reads back from its request's `kv_transfer_params` (vLLM carries them from the OpenAI request body to the
connector and from the producer's connector into the response: docs/connector.md "Prefill/decode").

The producer copies a request's KV into its CPU tier as it computes it (the connector's usual save), so it holds
no vLLM block for the consumer: the blocks are freed when the request finishes, and the chunks stay in the CPU
tier under its usual eviction. `request_finished` returns the producer's instance and its workers by rank. The
params reach the consumer as client input, so a `PeerHint` never names who serves: the consumer's lookup asks the
controller as for any P2P hit and reads each chunk from its holder of record (the first member of the domain to
admit it: services/controller/peers.py), which is the producer when it computed the prompt first. The hint only
makes that lookup wait a little while the producer is a live peer and its admissions have not reached the
controller yet (tiers/peer.py `PeerTier.expect`); a hint naming anything else promises nothing. The chunks load
asynchronously, rank for rank, over the peers' streams, each checked against the consumer's own key of the
request's tokens.

The fields follow vLLM's NIXL-style proxies (`do_remote_decode` to the producer, the producer's answer passed to
the consumer unchanged), so vLLM's toy proxy and `kvmesh pd-proxy` both drive it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

PEER_FIELD = "kvmesh_peer"  # the producer's instance and workers in kv_transfer_params
MAX_NAME = 256  # an instance or worker id longer than this is not one of ours (the params are client input)
MAX_RANKS = 1024


@dataclass(frozen=True)
class PeerHint:
    """The producer of a request's KV: its instance and its workers' ids, by rank."""

    instance_id: str
    workers: tuple[str, ...]

    def worker_of(self, rank: int) -> str | None:
        return self.workers[rank] if 0 <= rank < len(self.workers) else None


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A producer's request: the proxy asks for its KV to be handed to a consumer."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def producer_params(instance_id: str, workers: Sequence[str], num_tokens: int) -> dict[str, Any]:
    """The producer's answer for the consumer (`request_finished`'s kv_transfer_params)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": instance_id,
            "remote_num_tokens": num_tokens, PEER_FIELD: {"instance_id": instance_id, "workers": list(workers)}}


def peer_hint(params: Mapping[str, Any] | None) -> PeerHint | None:
    """The producer a consumer's request names, or None (no hint, or one that is not well-formed: the request is
    then looked up as any other)."""
    if not params or params.get("do_remote_prefill") is not True:
        return None
    peer = params.get(PEER_FIELD)
    if not isinstance(peer, Mapping):
        return None
    instance, workers = peer.get("instance_id"), peer.get("workers")
    if not _name(instance) or not isinstance(workers, list) or not 0 < len(workers) <= MAX_RANKS \
            or not all(_name(worker) for worker in workers):
        return None
    return PeerHint(instance, tuple(workers))


def _name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME
