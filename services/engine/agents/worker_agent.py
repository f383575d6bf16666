"""The worker agent: one engine worker's presence on the mesh.

Runs entirely on the engine's NATS loop thread, started once NATS is first reached. It
  * registers the worker (`RegisterEngine` on `Subjects.register(path)`), heartbeats, publishes batched
    admission/eviction events of the CPU tier with sequence numbers and answers full-sync requests (all
    through `AdmissionReporter`, producer_id = worker_id, location LocalCPUBackend);
  * answers `WorkerCommand`s on `Subjects.worker(instance_id, worker_id, op)` for op in pin / unpin / clear /
    lookup at any location, through the tier commands' one dispatch (`TierCommands.run`), move
    (`TierCommands.move`: a copy from `location` to `target`, or from another instance's CPU tier over P2P
    when the command names `peer_worker`), evict (chunks leave the CPU tier: the source's part of a move
    between instances) and prefetch (`TierCommands.prefetch`: the held prefix starts moving from the lower tiers
    into the CPU tier); tokens are hashed with the engine's ChunkHasher and the command's extras; the reply is
    `CommandReply(num_tokens=...)`;
  * answers health requests as service "engine";
  * logs a WARNING when the controller says other live workers claim this worker's instance id and rank
    (`InstanceConflict`: replicas started with the same lmcache_instance_id).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.services.engine.core.tier_commands import CheckMeta, TierCommands
from kvmesh.services.engine.tiers.peer import PeerTier, PeerWorker
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.admissions import AdmissionReporter
from kvmesh.shared.ops.service import serve_health
from kvmesh.shared.protocol import LOCAL_CPU, PEER, WORKER_COMMAND_OPS, CommandReply, WorkerCommand
from kvmesh.shared.wire.keys import ChunkHasher, ChunkSpan

log = logging.getLogger(__name__)

MAX_CONFLICT_NAMES = 8  # a conflict notice is untrusted input: log this many claimants at most


class WorkerAgent:
    """Registration, events and controller commands of one engine worker."""

    def __init__(self, instance_id: str, worker_id: str, hasher: ChunkHasher, commands: TierCommands,
                 registration: Callable[[], protocol.RegisterEngine], check_meta: CheckMeta,
                 write_queue_depth: Callable[[], int], heartbeat_interval: float = 2.0, flush_interval: float = 0.05,
                 state_block: int = 0) -> None:
        self.instance_id = instance_id
        self.state_block = state_block  # a model with recurrent state: commands cover the states too (KVLayout)
        self.worker_id = worker_id
        self.path = protocol.Principal.engine(instance_id).producer(worker_id)
        self.hasher = hasher
        self.commands = commands
        self.write_queue_depth = write_queue_depth  # chunks waiting for the write-behind (health)
        self.check_meta = check_meta  # a chunk read from a store for a move must be what its key holds
        self.cpu = commands.cpu
        self.reporter = AdmissionReporter(worker_id, self.path, LOCAL_CPU, self.cpu.held_keys, registration,
                                          flush_interval=flush_interval, heartbeat_interval=heartbeat_interval)
        self._subs: list[Subscription] = []
        self._started = False
        self._last_conflict: tuple[str, tuple[str, ...]] | None = None

    async def start(self, nc: NatsClient) -> None:
        # Report events from now on; the reporter's first full sync covers what was admitted before.
        self.cpu.listen(self.reporter)
        for op in WORKER_COMMAND_OPS:
            self._subs.append(await bus.serve(nc, protocol.Subjects.worker(self.instance_id, self.worker_id, op),
                                              WorkerCommand, self._make_handler(op)))
        self._subs.append(await nc.subscribe(
            protocol.Subjects.worker(self.instance_id, self.worker_id, protocol.CONFLICT_OP), cb=self._on_conflict))
        await serve_health(nc, "engine", self.worker_id, self.path, self._health)
        await self.reporter.start(nc)
        self._started = True
        log.info("worker %s registered on the mesh", self.worker_id)

    @property
    def started(self) -> bool:
        """Registered and answering commands (set once, after the first connect)."""
        return self._started

    async def stop(self) -> None:
        self.cpu.unlisten(self.reporter)
        if self._started:
            await self.reporter.stop()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs = []
        self._started = False

    async def _on_conflict(self, msg: Msg) -> None:
        try:
            notice = protocol.decode(msg.data, protocol.InstanceConflict)
        except protocol.ProtocolError as exc:
            log.debug("worker %s: dropped a bad conflict notice: %s", self.worker_id, exc)
            return
        seen = (notice.serving, tuple(notice.others[:MAX_CONFLICT_NAMES]))
        if seen == self._last_conflict:
            return  # said once already
        self._last_conflict = seen
        role = "this worker" if notice.serving == self.worker_id else f"worker {notice.serving!r}"
        log.warning("instance id %r (rank %d) is claimed by %d live workers: %s. They are not merged: the "
                    "controller serves the instance id from %s only. Give each vLLM replica its own "
                    "lmcache_instance_id", notice.instance_id, notice.rank, len(notice.others),
                    "; ".join(notice.others[:MAX_CONFLICT_NAMES]), role)

    def _health(self) -> dict[str, object]:
        return {"worker_id": self.worker_id, "cpu_chunks": len(self.cpu), "cpu_used_bytes": self.cpu.used_bytes,
                "write_behind_queue": self.write_queue_depth(), "time": time.time(),
                protocol.USAGE_DETAIL: self.cpu.usage().as_detail()}

    def _from_peer(self, command: WorkerCommand, spans: list[ChunkSpan]) -> str:
        """The source location of a move from the CPU tier of `command.peer_worker` (another instance of this
        domain): the peer tier, told to read these chunks from that worker."""
        if command.location != LOCAL_CPU:
            raise ValueError(f"a move between instances reads the source's CPU tier ({LOCAL_CPU}), not "
                             f"{command.location}")
        peers = self.commands.lower(PEER)
        if not isinstance(peers, PeerTier):
            raise LookupError("P2P is off on this worker (enable_p2p): it cannot read another instance's chunks")
        peers.assume_holder([span.key for span in spans], PeerWorker(command.peer_instance, command.peer_worker))
        return PEER

    def _make_handler(self, op: str) -> Callable[[WorkerCommand], object]:
        async def handle(command: WorkerCommand) -> CommandReply:
            if command.op != op:
                return CommandReply(ok=False, error=f"command op {command.op!r} sent on the {op!r} subject")
            return await self.execute(command)

        return handle

    async def execute(self, command: WorkerCommand) -> CommandReply:
        """Run one command; the reply's num_tokens is what actually happened (tokens pinned, cleared, found)."""
        spans, states = self.hasher.spans_and_states(command.tokens, command.extras, self.state_block) \
            if command.op != "clear" else ([], [])
        try:
            if command.op == "move":
                source, keep_source = command.location, command.keep_source
                if command.peer_worker:  # from another instance's CPU tier (P2P); its own part is the controller's
                    source, keep_source = self._from_peer(command, spans + states), True
                num_tokens = await self.commands.move(spans, source, command.target, keep_source, self.check_meta)
                moved_states = [span for span in states if span.end <= num_tokens]  # those of the chunks moved
                if moved_states:
                    await self.commands.move(moved_states, source, command.target, keep_source, self.check_meta)
            elif command.op == "evict":
                if command.location != LOCAL_CPU:
                    raise ValueError(f"evict drops chunks from the CPU tier ({LOCAL_CPU}) only, not {command.location}")
                num_tokens = self.commands.evict(spans)
                self.commands.evict(states)
            elif command.op == "prefetch":
                if command.location != LOCAL_CPU:
                    raise ValueError(f"prefetch warms the CPU tier ({LOCAL_CPU}) only, not {command.location}")
                num_tokens = await self.commands.prefetch(spans, self.check_meta)
            else:
                num_tokens = await self.commands.run(command.op, command.location, spans, command.ttl_secs, states)
        except (ValueError, LookupError) as exc:
            return CommandReply(ok=False, error=f"worker {self.worker_id}: {exc}")
        except Exception as exc:
            log.exception("worker %s: %s at %s failed", self.worker_id, command.op, command.location)
            return CommandReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        return CommandReply(ok=True, num_tokens=num_tokens)
