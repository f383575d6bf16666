"""pin / unpin / clear / prefetch: forwarded from the REST API to an instance's engine workers over NATS request/reply.

Runs on the controller's event loop, inside the REST request (the reply carries `num_tokens`). One
`WorkerCommand` goes to `Subjects.worker(instance_id, worker_id, op)` for every rank of the instance, concurrently, each
with the command timeout; the engine worker handles LocalCPUBackend itself and passes disk/remote commands
on to its stores. The answer is the minimum `num_tokens` over ranks: what is pinned/cleared on every shard.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError

from kvmesh.services.controller.errors import CommandFailed, CommandTimeout, MeshDown, NotFound, Refused
from kvmesh.services.controller.lookup import KeyRequest, UnknownAdapter, worker_extras
from kvmesh.services.controller.producer_records import Producer
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.shared import protocol
from kvmesh.shared.errors import ProtocolError
from kvmesh.shared.protocol import CONTROLLER_COMMAND_OPS, LOCAL_CPU, LOCATIONS, Subjects
from kvmesh.shared.wire.keys import KeyExtras

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommandTarget:
    """The workers a command goes to, and the producers whose keys it concerns (for clear)."""

    instance_id: str
    location: str
    workers: list[Producer]
    holders: list[str]  # producer_ids holding keys "at location" for this instance


class CommandRouter:
    """Resolves an (instance, location) to workers and runs a command on all of them."""

    def __init__(self, table: ProducerTable, timeout_s: float) -> None:
        self.table = table
        self.timeout_s = timeout_s
        self.nc: NatsClient | None = None

    def resolve(self, instance_id: str, location: str) -> CommandTarget:
        """The workers of `instance_id`, checking that it has `location`; NotFound naming what is missing."""
        if location not in LOCATIONS:
            raise NotFound(f"unknown location {location!r}; expected one of {', '.join(LOCATIONS)}")
        workers = self.table.workers_of(instance_id)
        if not workers:
            raise NotFound(f"unknown instance {instance_id!r}: no engine worker of it has registered")
        holders: list[str] = []
        for worker in workers:
            if location == LOCAL_CPU:
                holders.append(worker.producer_id)
                continue
            stores = self.table.stores_of(worker, location)
            if not stores:
                raise NotFound(f"instance {instance_id} has no {location}"
                               + (f" (rank {worker.engine.rank})" if worker.engine and len(workers) > 1 else ""))
            holders.extend(s for s in stores if s not in holders)
        return CommandTarget(instance_id, location, workers, holders)

    async def run(self, op: str, target: CommandTarget, tokens: list[int],
                  key_request: KeyRequest = KeyRequest(), move_to: str = "", keep_source: bool = True,
                  peers: dict[str, Producer] | None = None) -> int:
        """Send `op` to every worker of the target; the minimum num_tokens over ranks. `peers` (a move between
        instances): for each target worker, the source instance's worker it reads the chunks from (P2P).

        Raises NotFound (a LoRA adapter the instance never served), CommandTimeout (no answer / no
        responder: the worker is down), CommandFailed (an error reply) or MeshDown (the controller is not
        connected to NATS).
        """
        if op not in CONTROLLER_COMMAND_OPS:
            raise ValueError(f"unknown command {op!r}")
        peers = peers or {}
        payloads = [protocol.encode(protocol.WorkerCommand(
            op=op, location=target.location, tokens=tokens, extras=self._extras(worker, target, key_request),
            target=move_to, keep_source=keep_source,
            **_peer_fields(peers.get(worker.producer_id)))) for worker in target.workers]
        nc = self.nc
        if nc is None or not nc.is_connected:
            raise MeshDown(f"controller is not connected to NATS; cannot {op} on instance {target.instance_id}")
        replies = await asyncio.gather(*(self._one(nc, op, target.instance_id, worker.producer_id, payload)
                                         for worker, payload in zip(target.workers, payloads)),
                                       return_exceptions=True)
        _raise_failure(op, target.instance_id, replies)
        return min(r for r in replies if isinstance(r, int))

    def pair_ranks(self, source: CommandTarget, target: CommandTarget) -> dict[str, Producer]:
        """For a move between instances: each target worker's source worker of the same rank (the chunk keys
        name the rank). Refused when the instances' ranks differ or the source serves no peers."""
        by_rank = {w.engine.rank: w for w in source.workers if w.engine is not None}
        pairs: dict[str, Producer] = {}
        for worker in target.workers:
            assert worker.engine is not None
            peer = by_rank.get(worker.engine.rank)
            if peer is None or peer.engine is None or len(by_rank) != len(target.workers):
                raise Refused(f"instances {source.instance_id} and {target.instance_id} have different ranks: "
                              "a move between them would pair chunks of different shards")
            if not peer.engine.p2p or not worker.engine.p2p:
                raise Refused(f"a move between instances streams the chunks from {source.instance_id}'s CPU tier "
                              "to the other (P2P): both need enable_p2p")
            if peer.domain != worker.domain or peer.engine.domain != worker.engine.domain:  # principals, key roots
                raise Refused(f"instances {source.instance_id} and {target.instance_id} are in different sharing "
                              "domains: their chunks never meet")
            pairs[worker.producer_id] = peer
        return pairs

    @staticmethod
    def _extras(worker: Producer, target: CommandTarget, key_request: KeyRequest) -> KeyExtras | None:
        assert worker.engine is not None
        try:
            return worker_extras(worker.engine, key_request)
        except UnknownAdapter:
            raise NotFound(f"instance {target.instance_id} has not served LoRA adapter {key_request.lora_name!r} "
                           f"(worker {worker.producer_id}), so it holds nothing keyed with it") from None

    async def _one(self, nc: NatsClient, op: str, instance_id: str, worker_id: str, payload: bytes) -> int:
        subject = Subjects.worker(instance_id, worker_id, op)
        try:
            msg = await nc.request(subject, payload, timeout=self.timeout_s)
        except (NatsTimeoutError, asyncio.TimeoutError):
            raise CommandTimeout(f"instance {instance_id}: worker {worker_id} did not answer {op} within "
                                 f"{self.timeout_s:g}s") from None
        except NoRespondersError:
            raise CommandTimeout(f"instance {instance_id}: worker {worker_id} is not listening for {op} "
                                 f"(no responder on {subject}); is it down?") from None
        except Exception as exc:  # connection closed or reconnecting
            raise MeshDown(f"instance {instance_id}: {op} request to worker {worker_id} failed: "
                           f"{type(exc).__name__}: {exc}") from None
        try:
            reply = protocol.decode(msg.data, protocol.CommandReply)
        except ProtocolError as exc:
            try:
                ack = protocol.decode(msg.data, protocol.Ack)
            except ProtocolError:
                raise CommandFailed(f"instance {instance_id}: worker {worker_id} sent a bad {op} reply: {exc}") from None
            raise CommandFailed(f"instance {instance_id}: worker {worker_id} refused {op}: "
                                f"{ack.error or 'no reason given'}") from None
        if not reply.ok:
            raise CommandFailed(f"instance {instance_id}: worker {worker_id} failed {op}: "
                                f"{reply.error or 'no reason given'}")
        return reply.num_tokens


def _raise_failure(op: str, instance_id: str, replies: list[int | BaseException]) -> None:
    """Raise what a command whose workers answered `replies` fails with: a timeout anywhere (the instance as a
    whole did not complete), else the first error; nothing when every worker answered.

    Always a new exception, held by no variable: one kept in a frame it passes through (a worker's exception in
    `run`'s `replies`, or any local) makes a reference cycle through that frame and its token list, which only
    the cyclic GC frees, and late: 24 concurrent 1M-token /pin requests to a silent worker held 840 MiB at the
    default body bounds."""
    errors = [r for r in replies if isinstance(r, BaseException)]
    if not errors:
        return
    timeouts = [e for e in errors if isinstance(e, CommandTimeout)]
    first = timeouts[0] if timeouts else errors[0]
    if isinstance(first, (CommandTimeout, CommandFailed, MeshDown)):
        raise type(first)(first.message)
    raise CommandFailed(f"{op} on instance {instance_id} failed: {type(first).__name__}: {first}")


def _peer_fields(peer: Producer | None) -> dict[str, str]:
    if peer is None or peer.engine is None:
        return {}
    return {"peer_instance": peer.engine.instance_id, "peer_worker": peer.producer_id}
