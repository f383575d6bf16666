"""The controller's test parts (tests/controller/, and the engine, store and mesh tests that run a controller):
producers that speak the real protocol (`FakeEngineWorker`, `FakeStore`, `RawProducer`), the in-process
controller (`running_controller`) and waits on its /lookup and /instances."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, AsyncIterator, Callable

import httpx

from kvmesh.shared import protocol

from kvmesh.services.controller.config import ControllerConfig
from kvmesh.services.controller.service import ControllerService
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.admissions import AdmissionReporter
from kvmesh.shared.messaging.credentials import credentials_for
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, Subjects
from kvmesh.shared.wire.keys import ChunkHasher, KeyParams
from kvmesh.shared.wire.kv_events import ChunkDescription, pack_tokens

from support.waiting import WAIT_S, wait_until_async

MODEL, KV_FORMAT = "test-model", "bfloat16/test"


# ---------------------------------------------------------------------------------------------------------
# Producers that speak the real protocol


class FakeStore:
    """A disk or remote store's index: held chunk keys, reported through a real AdmissionReporter."""

    def __init__(self, nats_url: str, store_id: str, location: str) -> None:
        self.nats_url, self.store_id, self.location = nats_url, store_id, location
        self.chunks: dict[bytes, int] = {}  # key -> num_tokens
        self.nc: Any = None
        self.reporter = AdmissionReporter(store_id, protocol.store_path(store_id), location,
                                          held_keys=lambda: list(self.chunks),
                                          register=self.registration, flush_interval=0.02, heartbeat_interval=0.2)

    def registration(self) -> protocol.RegisterStore:
        return protocol.RegisterStore(store_id=self.store_id, location=self.location, started_at=1.0)

    def put(self, key: bytes, num_tokens: int) -> None:
        self.chunks[key] = num_tokens
        self.reporter.admit(key)

    def clear(self) -> int:
        cleared = sum(self.chunks.values())
        for key in self.chunks:
            self.reporter.evict(key)
        self.chunks.clear()
        return cleared

    async def start(self) -> "FakeStore":
        self.nc = await bus.connect(self.nats_url, name=self.store_id,
                                    auth=credentials_for(self.nats_url, protocol.Principal.store(self.store_id), None))
        await self.reporter.start(self.nc)
        return self

    async def stop(self) -> None:
        await self.reporter.stop()
        await self.nc.close()


class FakeEngineWorker:
    """One rank of an engine instance: a CPU tier of chunk keys, reported like the real engine worker does, and
    a responder for the controller's WorkerCommands (pin/unpin/clear), passing disk/remote to its stores.
    `incarnation` tags its worker id as a real engine process's is (`protocol.worker_id_for`); `conflicts` are the
    InstanceConflict notices it received."""

    def __init__(self, nats_url: str, instance_id: str, *, rank: int = 0, world_size: int = 1,
                 chunk_size: int = 256, disk: FakeStore | None = None, remotes: tuple[FakeStore, ...] = (),
                 started_at: float = 1.0, incarnation: str = "", host: str = "", ip: str = "",
                 p2p: bool = False, domain: str = "default", model: str = MODEL, kv_format: str = KV_FORMAT) -> None:
        self.nats_url, self.instance_id, self.rank, self.world_size = nats_url, instance_id, rank, world_size
        self.p2p, self.domain = p2p, domain  # the domain it *says* it is in (the controller checks it)
        self.worker_id = protocol.worker_id_for(instance_id, world_size, rank, incarnation)
        self.host, self.ip = host, ip
        self.conflicts: list[protocol.InstanceConflict] = []
        self.chunk_size, self.disk, self.remotes, self.started_at = chunk_size, disk, remotes, started_at
        self.model, self.kv_format = model, kv_format
        self.hasher = ChunkHasher(KeyParams(model, kv_format, world_size, rank), chunk_size)
        self.chunks: dict[bytes, int] = {}
        self.pinned: set[bytes] = set()
        self.commands: list[protocol.WorkerCommand] = []
        self.nc: Any = None
        self.path = protocol.Principal.engine(instance_id).producer(self.worker_id)
        self.reporter = AdmissionReporter(self.worker_id, self.path, LOCAL_CPU, held_keys=lambda: list(self.chunks),
                                          register=self.registration, flush_interval=0.02, heartbeat_interval=0.2)

    def registration(self) -> protocol.RegisterEngine:
        return protocol.RegisterEngine(
            worker_id=self.worker_id, instance_id=self.instance_id, model=self.model, kv_format=self.kv_format,
            world_size=self.world_size, rank=self.rank, chunk_size=self.chunk_size, save_unfull_chunk=True,
            disk_store=self.disk.store_id if self.disk else None,
            remote_stores=[r.store_id for r in self.remotes], started_at=self.started_at, host=self.host, ip=self.ip,
            p2p=self.p2p, domain=self.domain)

    def spans(self, tokens: list[int]) -> list[Any]:
        return self.hasher.spans(tokens)

    def store(self, tokens: list[int], chunks: list[int] | None = None, where: str = LOCAL_CPU,
              describe: bool = False, lora_name: str | None = None,
              extra_keys: tuple[object, ...] | None = None) -> None:
        """Hold chunks `chunks` (default: all) of `tokens` at `where` (remote: spread over the partitions); with
        `describe`, the CPU tier's admissions carry each chunk's parent and tokens (and `lora_name`, `extra_keys`),
        as an engine's saves do with describe_admissions."""
        spans = self.spans(tokens)
        for span in spans:
            if chunks is not None and span.index not in chunks:
                continue
            if where == LOCAL_CPU:
                self.chunks[span.key] = span.num_tokens
                if describe:
                    parent = spans[span.index - 1].key if span.index else None
                    self.reporter.describe(span.key, ChunkDescription(
                        parent, pack_tokens(tokens[span.start:span.end]), extra_keys, lora_name))
                self.reporter.admit(span.key)
            elif where == LOCAL_DISK:
                assert self.disk is not None
                self.disk.put(span.key, span.num_tokens)
            else:
                self.remotes[span.index % len(self.remotes)].put(span.key, span.num_tokens)

    def _held(self, location: str) -> dict[bytes, int]:
        if location == LOCAL_CPU:
            return self.chunks
        if location == LOCAL_DISK and self.disk:
            return self.disk.chunks
        merged: dict[bytes, int] = {}
        for remote in self.remotes:
            merged.update(remote.chunks)
        return merged

    async def _on_command(self, command: protocol.WorkerCommand) -> protocol.CommandReply:
        self.commands.append(command)
        held = self._held(command.location)
        if command.op == "clear":
            if command.location == LOCAL_CPU:
                cleared = sum(self.chunks.values())
                for key in self.chunks:
                    self.reporter.evict(key)
                self.chunks.clear()
                self.pinned.clear()
            else:
                stores = [self.disk] if command.location == LOCAL_DISK else list(self.remotes)
                cleared = sum(store.clear() for store in stores if store)
            return protocol.CommandReply(ok=True, num_tokens=cleared)
        if command.op == "move":  # the held prefix goes to the target location (and leaves the CPU tier)
            return protocol.CommandReply(ok=True, num_tokens=self._move(command))
        num_tokens = 0
        for span in self.spans(command.tokens):  # pin/unpin: the held prefix
            if span.key not in held:
                break
            (self.pinned.add if command.op == "pin" else self.pinned.discard)(span.key)
            num_tokens += span.num_tokens
        return protocol.CommandReply(ok=True, num_tokens=num_tokens)

    def _move(self, command: protocol.WorkerCommand) -> int:
        held, moved = self._held(command.location), []
        for span in self.spans(command.tokens):
            if span.key not in held:
                break
            moved.append(span)
        for span in moved:
            if command.target == LOCAL_CPU:
                self.chunks[span.key] = span.num_tokens
                self.reporter.admit(span.key)
            elif command.target == LOCAL_DISK:
                assert self.disk is not None
                self.disk.put(span.key, span.num_tokens)
            else:
                self.remotes[span.index % len(self.remotes)].put(span.key, span.num_tokens)
            if not command.keep_source:
                del self.chunks[span.key]
                self.reporter.evict(span.key)
        return sum(span.num_tokens for span in moved)

    async def start(self) -> "FakeEngineWorker":
        self.nc = await bus.connect(self.nats_url, name=self.worker_id,
                                    auth=credentials_for(self.nats_url, protocol.Principal.engine(self.instance_id), None))
        for op in ("pin", "unpin", "clear", "move"):
            await bus.serve(self.nc, Subjects.worker(self.instance_id, self.worker_id, op), protocol.WorkerCommand,
                            self._on_command)

        async def on_conflict(msg: Any) -> None:
            self.conflicts.append(protocol.decode(msg.data, protocol.InstanceConflict))

        await self.nc.subscribe(Subjects.worker(self.instance_id, self.worker_id, protocol.CONFLICT_OP), cb=on_conflict)
        await self.nc.flush()
        await self.reporter.start(self.nc)
        return self

    async def stop(self) -> None:
        await self.reporter.stop()
        await self.nc.close()


class RawProducer:
    """An engine worker that numbers its batches by hand (to lose some), counts SyncRequests and answers them
    with a full sync of `held`."""

    def __init__(self, nats_url: str, instance_id: str, chunk_size: int = 4) -> None:
        self.nats_url, self.worker_id, self.instance_id = nats_url, instance_id, instance_id
        self.path = protocol.Principal.engine(instance_id).producer(instance_id)
        self.hasher = ChunkHasher(KeyParams(MODEL, KV_FORMAT), chunk_size)
        self.chunk_size = chunk_size
        self.held: set[bytes] = set()
        self.seq = 0
        self.sync_requests: list[str] = []
        self.nc: Any = None

    def keys(self, tokens: list[int]) -> list[bytes]:
        return self.hasher.keys(tokens)

    async def start(self, register: bool = True) -> "RawProducer":
        self.nc = await bus.connect(self.nats_url, name=self.worker_id,
                                    auth=credentials_for(self.nats_url, protocol.Principal.engine(self.instance_id), None))
        await bus.serve(self.nc, Subjects.sync(self.path), protocol.SyncRequest, self._on_sync)
        await self.nc.flush()
        if register:
            await bus.publish(self.nc, Subjects.register(self.path), protocol.RegisterEngine(
                worker_id=self.worker_id, instance_id=self.instance_id, model=MODEL, kv_format=KV_FORMAT,
                world_size=1, rank=0, chunk_size=self.chunk_size, save_unfull_chunk=True, started_at=1.0))
            await self.publish_sync()  # as the real reporter does: register, then a full sync
        return self

    async def batch(self, admitted: list[bytes] = (), evicted: list[bytes] = (), lose: bool = False) -> None:
        """The next batch: applied to `held`; published unless `lose`."""
        self.seq += 1
        self.held.update(admitted)
        self.held.difference_update(evicted)
        if not lose:
            await bus.publish(self.nc, Subjects.events(self.path), protocol.AdmissionBatch(
                producer_id=self.worker_id, location=LOCAL_CPU, seq=self.seq, admitted=list(admitted),
                evicted=list(evicted)))

    async def heartbeat(self, last_seq: int | None = None) -> None:
        await bus.publish(self.nc, Subjects.heartbeat(self.path), protocol.Heartbeat(
            producer_id=self.worker_id, last_seq=self.seq if last_seq is None else last_seq, time=time.time()))

    async def _on_sync(self, request: protocol.SyncRequest) -> protocol.Ack:
        self.sync_requests.append(request.reason)
        await self.publish_sync()
        return protocol.Ack()

    async def publish_sync(self) -> None:
        keys, sync_id = sorted(self.held), uuid.uuid4().hex
        parts = [keys[i:i + 2] for i in range(0, len(keys), 2)] or [[]]  # several parts on purpose
        for index, part in enumerate(parts):
            await bus.publish(self.nc, Subjects.events(self.path), protocol.SyncChunk(
                producer_id=self.worker_id, location=LOCAL_CPU, sync_id=sync_id, seq=self.seq, part=index,
                final=index == len(parts) - 1, keys=part))

    async def stop(self) -> None:
        await self.nc.close()


# ---------------------------------------------------------------------------------------------------------
# Fixtures


def _config(nats_url: str, **overrides: Any) -> ControllerConfig:
    # Timeouts nothing should reach while a test runs (a producer is never down for being slow, a fake worker's
    # answer is never too late); the tests of a timeout set a short one, or run the controller on a ManualClock.
    settings: dict[str, Any] = dict(host="127.0.0.1", port=0, nats_url=nats_url, controller_id="controller-test",
                                    liveness_timeout_s=2 * WAIT_S, command_timeout_s=WAIT_S, tick_interval_s=0.05,
                                    sync_retry_s=1.0, heartbeat_grace_s=0.3, min_chunk_size=1)
    settings.update(overrides)
    return ControllerConfig(**settings)


@contextlib.asynccontextmanager
async def running_controller(nats_url: str, clock: Callable[[], float] = time.monotonic,
                             **overrides: Any) -> AsyncIterator[tuple[ControllerService, httpx.AsyncClient]]:
    service = await ControllerService(_config(nats_url, **overrides), clock).start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=WAIT_S) as client:
            yield service, client
    finally:
        await service.stop()


@contextlib.asynccontextmanager
async def started(*producers: Any) -> AsyncIterator[None]:
    for producer in producers:
        await producer.start()
    try:
        yield
    finally:
        for producer in reversed(producers):
            await producer.stop()


async def layout(client: httpx.AsyncClient, tokens: list[int]) -> dict[str, list[Any]]:
    response = await client.post("/lookup", json={"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["layout_info"]


async def wait_layout(client: httpx.AsyncClient, tokens: list[int], expected: dict[str, list[Any]],
                      what: str = "lookup") -> None:
    async def matches() -> bool:
        return await layout(client, tokens) == expected
    try:
        await wait_until_async(matches, what=f"{what} == {expected}")
    except TimeoutError:
        raise AssertionError(f"{what}: got {await layout(client, tokens)}, expected {expected}") from None


async def _has_instance(client: httpx.AsyncClient, instance_id: str) -> bool:
    instances = (await client.get("/instances")).json()["instances"]
    return any(i["instance_id"] == instance_id for i in instances)
