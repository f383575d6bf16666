"""The worker agent: one engine worker's presence on the mesh.

Runs entirely on the engine's NATS loop thread, started once NATS is first reached. It
  * registers the worker (`RegisterEngine` on `Subjects.REGISTER`), heartbeats, publishes batched
    admission/eviction events of the CPU tier with sequence numbers and answers full-sync requests (all
    through `AdmissionReporter`, producer_id = worker_id, location LocalCPUBackend);
  * answers `WorkerCommand`s on `Subjects.worker(worker_id, op)` for op in pin / unpin / clear / lookup:
    LocalCPUBackend ones on the CPU tier, LocalDiskBackend / RemoteBackend ones through the store clients
    (tokens are hashed with the engine's ChunkHasher), replying `CommandReply(num_tokens=...)`;
  * answers health requests as service "engine".
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvmesh.services.engine.tiers.cpu import LocalCPUBackend
from kvmesh.services.engine.core.storage_manager import StorageManager
from kvmesh.shared import bus, protocol
from kvmesh.shared.admissions import AdmissionReporter
from kvmesh.shared.keys import ChunkHasher, ChunkSpan
from kvmesh.shared.protocol import LOCAL_CPU, LOCATIONS, CommandReply, WorkerCommand
from kvmesh.shared.service import serve_health

log = logging.getLogger(__name__)

OPS = ("pin", "unpin", "clear", "lookup")


def worker_id_for(instance_id: str, world_size: int, rank: int) -> str:
    """`instance_id` for a single-rank instance, else one id per rank."""
    return instance_id if world_size == 1 else f"{instance_id}.r{rank}"


class WorkerAgent:
    """Registration, events and controller commands of one engine worker."""

    def __init__(self, worker_id: str, hasher: ChunkHasher, cpu: LocalCPUBackend, storage: StorageManager,
                 registration: Callable[[], protocol.RegisterEngine], heartbeat_interval: float = 2.0,
                 flush_interval: float = 0.05) -> None:
        self.worker_id = worker_id
        self.hasher = hasher
        self.cpu = cpu
        self.storage = storage
        self.reporter = AdmissionReporter(worker_id, LOCAL_CPU, cpu.held_keys, registration,
                                          flush_interval=flush_interval, heartbeat_interval=heartbeat_interval)
        self._subs: list[Subscription] = []
        self._started = False
        self.commands_handled = 0

    async def start(self, nc: NatsClient) -> None:
        # Report events from now on; the reporter's first full sync covers what was admitted before.
        self.cpu.attach_reporter(self.reporter)
        for op in OPS:
            self._subs.append(await bus.serve(nc, protocol.Subjects.worker(self.worker_id, op), WorkerCommand,
                                              self._make_handler(op)))
        await serve_health(nc, "engine", self.worker_id, self._health)
        await self.reporter.start(nc)
        self._started = True
        log.info("worker %s registered on the mesh", self.worker_id)

    @property
    def started(self) -> bool:
        """Registered and answering commands (set once, after the first connect)."""
        return self._started

    async def stop(self) -> None:
        self.cpu.attach_reporter(None)
        if self._started:
            await self.reporter.stop()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs = []
        self._started = False

    def _health(self) -> dict[str, object]:
        return {"worker_id": self.worker_id, "cpu_chunks": len(self.cpu), "cpu_used_bytes": self.cpu.used_bytes,
                "write_behind_queue": self.storage.queue_depth, "time": time.time()}

    def _make_handler(self, op: str) -> Callable[[WorkerCommand], object]:
        async def handle(command: WorkerCommand) -> CommandReply:
            self.commands_handled += 1
            if command.op != op:
                return CommandReply(ok=False, error=f"command op {command.op!r} sent on the {op!r} subject")
            try:
                return await self.execute(command)
            except Exception as exc:
                log.exception("worker %s: %s at %s failed", self.worker_id, op, command.location)
                return CommandReply(ok=False, error=f"{type(exc).__name__}: {exc}")

        return handle

    async def execute(self, command: WorkerCommand) -> CommandReply:
        """Run one command; the reply's num_tokens is what actually happened (tokens pinned, cleared, found)."""
        location, op = command.location, command.op
        if location not in LOCATIONS:
            return CommandReply(ok=False, error=f"unknown location {location!r} (known: {', '.join(LOCATIONS)})")
        if op not in OPS:
            return CommandReply(ok=False, error=f"unknown op {op!r} (known: {', '.join(OPS)})")
        spans = self.hasher.spans(command.tokens, extras=command.extras) if op != "clear" else []
        keys = [s.key for s in spans]
        if location == LOCAL_CPU:
            if op == "pin":
                return CommandReply(ok=True, num_tokens=self.cpu.pin(keys, command.ttl_secs))
            if op == "unpin":
                return CommandReply(ok=True, num_tokens=self.cpu.unpin(keys))
            if op == "clear":
                return CommandReply(ok=True, num_tokens=self.cpu.clear())
            return CommandReply(ok=True, num_tokens=_tokens(spans, self.cpu.prefix(keys)))
        client = self.storage.client(location)
        if client is None:
            return CommandReply(ok=False, error=f"worker {self.worker_id} has no {location} configured "
                                                f"(or its store client is not connected)")
        num_tokens = [s.num_tokens for s in spans]
        if op == "pin":
            return CommandReply(ok=True, num_tokens=await client.pin(keys, num_tokens, command.ttl_secs))
        if op == "unpin":
            return CommandReply(ok=True, num_tokens=await client.unpin(keys, num_tokens))
        if op == "clear":
            return CommandReply(ok=True, num_tokens=await client.clear())
        return CommandReply(ok=True, num_tokens=_tokens(spans, await client.contains(keys)))


def _tokens(spans: list[ChunkSpan], num_chunks: int) -> int:
    return sum(s.num_tokens for s in spans[:num_chunks])
