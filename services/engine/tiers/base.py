"""The tier interface: what the engine asks of every place a chunk can be (CPU tier, disk store, remote store).

`Tier` is the control part every tier answers, the same way: `contains` (the held prefix of some keys), `pin`
and `unpin` (the held or pinned prefix), `clear` (what this engine put there: a store forgets only chunks no
other caller claims) and `touch` (a hit: the chunks were just used, refresh their recency). The storage manager
walks its tiers as one ordered list (CPU, disk, remote) for lookups and fetches, and dispatches the controller's
commands through this interface.

`StoreTier` adds the data part of a lower tier: `put` a chunk from a buffer and `get_into` a buffer. The CPU
tier does not copy: its chunks already live in the memory pool's slots, so its data path hands out slot
references (`LocalCPUBackend.acquire` / `put`) instead.

`ChunkBuffer` names where chunk bytes live in the engine: a view, and if the view lies in the engine's shared
pool (a sealed memfd, shared/wire/shm.py), that pool and the offset, so the disk store on the same host, once the
pool is lent to it, can read or write the bytes in place (no bytes through NATS). The disk store and the
remote store each provide a `StoreTier` client (disk.py, remote.py here). All methods are coroutines on the
engine's NATS loop; none raises on a dead store: they log and answer a miss / False / 0 (a failing store never
fails vLLM). One exception, which the storage manager handles: `get_into` raises `StoreMayWrite` when a store
that writes into the buffer in place did not answer, so the buffer stays out of use until the store settles. `StoreLink` is how both clients do that: one per store, it sends the requests on subjects ending
in the client's caller path (`Principal.engine(instance_id).producer(worker_id)` for an engine worker: who
puts, and whose claims a `clear` takes back) and logs each change of the store's state once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from nats.aio.client import Client as NatsClient

from kvmesh.shared.errors import KVMeshError, NoResponder
from kvmesh.shared.messaging import bus
from kvmesh.shared.protocol import ChunkMeta, StatsReply, Subjects
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.shm import SharedSegment

T = TypeVar("T")


@dataclass(frozen=True)
class Retention:
    """How long a storing request wants its chunks kept (its `kv_priority` and lease: adapter/request_retention.py):
    `priority` > 0 keeps them over the rest while held, a lease until `lease_until` (unix seconds) over unleased
    ones. Where the chunks are held, each principal keeps at most its share this way."""

    priority: int = 0
    lease_until: float | None = None

    def lease_secs(self, now: float | None = None) -> float | None:
        """Seconds of lease left (None: no lease, or it has ended)."""
        if self.lease_until is None:
            return None
        left = self.lease_until - (time.time() if now is None else now)
        return left if left > 0 else None

    @property
    def asked(self) -> bool:
        return self.priority > 0 or self.lease_until is not None


NO_RETENTION = Retention()


class StoreMayWrite(Exception):
    """`get_into` got no answer from a store that writes into the buffer in place (the disk store, through the
    lent pool): the request may still be served later, so the buffer must not be reused yet. `settled()`
    resolves once the store can no longer write into it: True (reuse it), or False when that can no longer be
    known (the client closed): keep the buffer out of use for good."""

    def __init__(self, reason: str, settled: Callable[[], Awaitable[bool]]) -> None:
        super().__init__(reason)
        self.settled = settled


class Unanswered(Exception):
    """`StoreLink.exchange`: the request was sent and no proper reply came back (it may still be acted upon)."""


@dataclass(frozen=True)
class ChunkBuffer:
    view: memoryview  # byte view, len >= the chunk's nbytes
    pool: SharedSegment | None = None  # the shared pool holding `view`, if any
    pool_offset: int = 0  # offset of `view` inside that pool


def byte_view(view: memoryview) -> memoryview:
    """`view` as flat bytes (a slot's view may be typed or shaped)."""
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Tier(Protocol):
    location: str  # protocol.LOCAL_CPU, LOCAL_DISK or REMOTE

    async def contains(self, keys: list[ChunkKey]) -> int:
        """How many leading `keys` the tier holds; 0 when it cannot be reached."""

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        """Pin the contiguous held prefix of `keys`; the number of tokens pinned."""

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        """Drop one pin from each key of the contiguous pinned prefix; the number of tokens unpinned."""

    async def clear(self) -> int:
        """Remove what this engine may remove (see each tier); the number of tokens cleared. A store takes back
        the caller's claims and answers the tokens of the chunks it no longer claims (shared/store_kit/store_ops.py)."""

    async def touch(self, keys: list[ChunkKey]) -> None:
        """The chunks were just used: make them the most recently used ones the tier holds (best effort)."""


class StoreTier(Tier, Protocol):
    store_ids: list[str]  # the store(s) behind this client (one per remote partition)

    async def put(self, meta: ChunkMeta, buffer: ChunkBuffer,
                  retention: Retention = NO_RETENTION) -> bool:
        """Hand a chunk to the store (meta.checksum set: a put without one is refused); True once the store has
        the bytes and they match the checksum (it may still be writing them). `retention`: the storing request's
        (the disk and remote stores honour it; Redis and peers take the chunk as any other)."""

    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> ChunkMeta | None:
        """Fill `buffer` with the chunk's bytes (checksum verified); None on a miss or any failure after which
        nothing writes into `buffer` any more. Raises StoreMayWrite when a store may still write into it later
        (only a client whose store writes in place: the disk store's)."""

    async def remove(self, keys: list[ChunkKey]) -> int:
        """Remove chunks; how many were removed."""

    async def stats(self) -> list[StatsReply]:
        """One StatsReply per store behind the client (missing entries for unreachable stores)."""


NO_RESPONDER_GRACE_S = 1.0  # how long a reachable store's "no responder" is taken for a moment's gap


class StoreLink:
    """A client's view of one store: whether it answers and whether it takes puts, each logged once per change
    (not once per call) on the client's own logger, as "<label> unreachable ..." / "... reachable again".

    After a failure the store is not asked again for `retry_interval` seconds (`resting`), so a vanished host
    costs one timeout, not one per call; 0 asks every time. A request of a reachable store that finds no
    responder is sent again for up to NO_RESPONDER_GRACE_S first (nobody got it, so resending is safe): a store
    subscribes an engine principal it newly serves within a moment (its lanes follow the domains map, which the
    engine's own provisioning just wrote; shared/store_kit/store_endpoint.py), and a restarting store does the same.
    Requests go to `Subjects.store(store_id, op, caller)`: `caller` is the client's path, the only one its NATS
    credentials may publish store ops on.
    """

    def __init__(self, store_id: str, label: str, log: logging.Logger, caller: str,
                 retry_interval: float = 0.0) -> None:
        self.store_id = store_id
        self.label = label  # e.g. "disk store disk-h1"
        self.caller = caller
        self.retry_interval = retry_interval
        self.reachable = True
        self.refusing = False  # its last put was refused
        self._down_until = 0.0  # monotonic
        self._log = log

    @property
    def resting(self) -> bool:
        return self._down_until > time.monotonic()

    async def request(self, nc: NatsClient, op: str, message: Any, reply_type: type[T], timeout: float) -> T | None:
        """The store's reply to `message` on its `op` subject; None (never an exception) when it does not answer
        properly or is resting."""
        try:
            return await self.exchange(nc, op, message, reply_type, timeout)
        except Unanswered:
            return None

    async def exchange(self, nc: NatsClient, op: str, message: Any, reply_type: type[T], timeout: float) -> T | None:
        """`request`, telling apart what was never sent (None: resting) from what was sent and got no proper
        reply (Unanswered: the store may yet act on it; a request during a reconnect may even go out later)."""
        if self.resting:
            return None
        try:
            reply = await self._request(nc, op, message, reply_type, timeout)
        except KVMeshError as exc:  # MeshUnavailable (no responder, timeout, error reply), ProtocolError (bad reply)
            self.failed(exc)
            raise Unanswered(str(exc)) from None
        except Exception as exc:  # never let a store problem reach vLLM
            self._log.exception("%s: unexpected error on %s", self.label, op)
            self.failed(exc)
            raise Unanswered(str(exc)) from None
        self.answered()
        return reply

    async def _request(self, nc: NatsClient, op: str, message: Any, reply_type: type[T], timeout: float) -> T:
        waited, pause = 0.0, 0.05
        while True:
            try:
                return await bus.request(nc, self.subject(op), message, reply_type, timeout)
            except NoResponder:
                if not self.reachable or waited >= NO_RESPONDER_GRACE_S:
                    raise
            await asyncio.sleep(pause)
            waited += pause
            pause = min(pause * 2, 0.25)

    def subject(self, op: str) -> str:
        return Subjects.store(self.store_id, op, self.caller)

    def failed(self, reason: object) -> None:
        self._down_until = time.monotonic() + self.retry_interval
        if self.reachable:
            self.reachable = False
            self._log.warning("%s unreachable (%s); answering misses until it is back", self.label, reason)

    def answered(self) -> None:
        if not self.reachable:
            self.reachable = True
            self._log.info("%s reachable again", self.label)

    def refused(self, reason: str) -> None:
        """A put was refused (full, bad chunk, ...)."""
        if not self.refusing:
            self.refusing = True
            self._log.warning("%s refused a put: %s (further refusals are logged at debug level until a put "
                              "succeeds)", self.label, reason)
        else:
            self._log.debug("%s refused a put: %s", self.label, reason)

    def accepted(self) -> None:
        if self.refusing:
            self.refusing = False
            self._log.info("%s accepts puts again", self.label)
