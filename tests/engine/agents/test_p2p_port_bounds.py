"""The P2P stream port holds (issue 36, findings 3 and 6): real cache engines with enable_p2p on a real NATS, with a
real controller. Engine A computes a prompt and serves its CPU tier on its peer port; engine B loads it from there,
every load checked against the KV oracle. Meanwhile an attacker, a plain TCP client or a peer instance speaking the
stream protocol with tickets of its own, pushes on each bound of A's port (services/engine/agents/peer_server.py,
shared/wire/stream_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import AsyncIterator, Iterator

import pytest
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.tiers.remote_stream import StreamConnection
from kvmesh.shared import protocol
from kvmesh.shared.errors import StoreError
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.protocol import PEER, Subjects
from kvmesh.shared.wire.keys import KeyParams
from kvmesh.shared.wire.stream_server import StreamServer

from support.controller import running_controller
from support.engine import CHUNK, PagedKV, engine_config, random_tokens
from support.kv_oracle import ContextForward
from support.waiting import WAIT_S, wait_until, wait_until_async

PARAMS = KeyParams(model="test-model", kv_format="")
BLOCKS = 64
SCRATCH = list(range(BLOCKS - 16, BLOCKS))  # the oracle's own blocks
TOKENS = 5 * CHUNK + 7  # five full chunks and a partial one
CHUNKS = -(-TOKENS // CHUNK)


@pytest.fixture
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as server:
        yield server.url


@contextlib.asynccontextmanager
async def engines(url: str, a_config: dict[str, object] | None = None, b_config: dict[str, object] | None = None
                  ) -> AsyncIterator[tuple[CacheEngine, PagedKV, CacheEngine, PagedKV]]:
    """A controller, then engines A and B with P2P (each over its own random paged KV), all stopped after."""

    def engine(instance: str, kv: PagedKV, overrides: dict[str, object]) -> CacheEngine:
        started = build_engine(engine_config(nats_url=url, lmcache_instance_id=instance, enable_p2p=True, **overrides),
                               PARAMS, kv.layout)
        assert started.wait_connected(WAIT_S), f"engine {instance} did not reach NATS"
        wait_until(lambda: started.storage.lower(PEER) is not None and started.mesh.agent.started
                   and started.mesh.peer_server is not None and started.mesh.peer_server.server.listening,
                   what=f"{instance} serving peers")
        return started

    kv_a, kv_b = PagedKV(num_blocks=BLOCKS, seed=1), PagedKV(num_blocks=BLOCKS, seed=2)
    async with running_controller(url):
        a = await asyncio.to_thread(engine, "peer-a", kv_a, a_config or {})
        try:
            b = await asyncio.to_thread(engine, "peer-b", kv_b, b_config or {})
            try:
                yield a, kv_a, b, kv_b
            finally:
                await asyncio.to_thread(b.close)
        finally:
            await asyncio.to_thread(a.close)


def slots_of(blocks: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    return torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(num_tokens)])


async def computed_at_a(a: CacheEngine, kv_a: PagedKV, b: CacheEngine, seed: int) -> list[int]:
    """A prompt that A computed and stored, once B's lookup finds all of it (at A: B's own tiers hold nothing)."""
    tokens = random_tokens(TOKENS, seed=seed).tolist()
    blocks = list(range(-(-TOKENS // kv_a.block_size)))

    def compute() -> None:
        ContextForward(kv_a, SCRATCH).run(tokens, blocks, 0, TOKENS)
        token_api.store(a, torch.tensor(tokens), **kv_a.kv(slots_of(blocks, TOKENS, kv_a.block_size)))

    async def found() -> bool:
        return await asyncio.to_thread(token_api.lookup, b, tokens) == TOKENS

    await asyncio.to_thread(compute)
    await wait_until_async(found, what="B's lookup to find A's chunks")
    return tokens


async def loads_right(b: CacheEngine, kv_b: PagedKV, tokens: list[int]) -> bool:
    """B loads the whole prompt, and every block holds the oracle's KV."""
    blocks = list(range(10, 10 + -(-TOKENS // kv_b.block_size)))
    mask = await asyncio.to_thread(token_api.retrieve, b, torch.tensor(tokens), **kv_b.kv(slots_of(blocks, TOKENS,
                                                                                          kv_b.block_size)))
    return int(mask.sum()) == TOKENS and ContextForward(kv_b, SCRATCH).holds(tokens, blocks, TOKENS)


def stream_server(engine: CacheEngine) -> StreamServer:
    assert engine.mesh.peer_server is not None
    return engine.mesh.peer_server.server


def peer_address(engine: CacheEngine) -> tuple[str, int]:
    host, port = engine.mesh.peer_server.endpoint.rsplit(":", 1)
    return host, int(port)


def closed_by_server(server: StreamServer) -> int:
    """Connections the server closed before their hello, whatever the bound (those it knows of)."""
    return sum(server.counters.get(name, 0) for name in ("stream_refused_over_cap", "stream_pending_closed"))


async def test_silent_connections_without_a_ticket_never_stop_a_peer_load(nats_url: str) -> None:
    """20 silent TCP connections to A's peer port, from B's own address, at A's default settings: they used to
    fill its 16 connections and every peer load failed until they timed out. Pending connections are capped apart
    (per address and in all) and a newer one pushes out the oldest, so B's connections get in and greet."""
    async with engines(nats_url) as (a, kv_a, b, kv_b):
        tokens = await computed_at_a(a, kv_a, b, seed=7)
        server = stream_server(a)
        assert peer_address(a)[0] == "127.0.0.1"  # loopback: no p2p_host given
        silent = []
        try:
            for _ in range(20):
                sock = socket.create_connection(peer_address(a))
                silent.append(sock)
            await wait_until_async(lambda: server.connection_count + closed_by_server(server) == 20,
                                   what="A's port to have taken all 20 connections")
            assert await loads_right(b, kv_b, tokens)
            assert b.storage.stats[f"fetched_{PEER}"] == CHUNKS and b.storage.stats["p2p_read_failed"] == 0
            assert server.pending_count <= a.config.p2p_max_pending_per_address
            assert server.counters["stream_pending_closed"] >= 20 - a.config.p2p_max_pending_per_address
        finally:
            for sock in silent:
                sock.close()


async def test_a_silent_connection_is_closed_after_the_hello_timeout_and_the_port_is_loopback(nats_url: str) -> None:
    async with engines(nats_url, {"p2p_hello_timeout_secs": 0.2}) as (a, kv_a, b, kv_b):
        server = stream_server(a)
        with socket.create_connection(peer_address(a)) as sock:
            await wait_until_async(lambda: server.counters["stream_hello_timeouts"] == 1, what="the hello timeout")
            assert sock.recv(1) == b""  # closed by A, not a byte sent
        assert server.host == "127.0.0.1"


async def ticket(nc: object, a: CacheEngine, caller: str) -> protocol.StreamOffer:
    """A ticket to A's port in `caller`'s name, asked on A's peer subject as any engine of its domain may."""
    subject = Subjects.peer_stream(a.mesh.domain_name, "peer-a", a.worker_id, caller)
    return await bus.request(nc, subject, protocol.StreamRequest(client="peer-c"), protocol.StreamOffer, WAIT_S)


async def test_one_peer_holds_at_most_its_share_of_the_greeted_connections(nats_url: str) -> None:
    """Peer C (an engine instance of the domain: it may ask A for tickets) opens 16 connections, each with a
    valid ticket, and holds them idle. A serves 16 at once: C used to take them all, and B's loads failed. C gets
    `p2p_max_connections_per_peer` (the rest are refused after their hello), and B loads."""
    async with engines(nats_url) as (a, kv_a, b, kv_b):
        tokens = await computed_at_a(a, kv_a, b, seed=8)
        nc = await bus.connect(nats_url, "peer-c")
        caller = protocol.Principal.engine("peer-c").producer("peer-c")
        opened: list[StreamConnection] = []
        refused = 0
        try:
            for _ in range(a.config.p2p_max_connections):
                try:
                    opened.append(await StreamConnection.open(await ticket(nc, a, caller), "peer-c"))
                except StoreError as exc:
                    assert "connections open" in str(exc)
                    refused += 1
            assert await loads_right(b, kv_b, tokens)
            assert b.storage.stats["p2p_read_failed"] == 0
            assert len(opened) == a.config.p2p_max_connections_per_peer
            assert refused == a.config.p2p_max_connections - len(opened)
        finally:
            for connection in opened:
                connection.close()
            await nc.close()


async def test_a_ticket_is_bounded_in_bytes_and_paced(nats_url: str) -> None:
    """A's tickets carry two chunks each, at 50 kB/s: B's load still arrives whole and right, over more tickets
    (A closes each connection once its bytes are spent; B asks for a new one), and A made replies wait."""
    chunk_bytes = PagedKV(num_blocks=1).layout.chunk_nbytes(CHUNK)
    bounds = {"p2p_ticket_max_gb": 2 * chunk_bytes / 1024**3, "p2p_ticket_max_mb_per_s": 0.05}
    async with engines(nats_url, bounds) as (a, kv_a, b, kv_b):
        tokens = await computed_at_a(a, kv_a, b, seed=9)
        server = stream_server(a)
        assert await loads_right(b, kv_b, tokens)
        assert a.storage.stats["p2p_served_chunks"] == CHUNKS and b.storage.stats["p2p_read_failed"] == 0
        assert server.counters["stream_tickets_spent"] >= 1 and server.counters["stream_replies_paced"] >= 1
        assert server.counters["stream_tickets_issued"] >= CHUNKS // 2


async def test_a_peer_stream_is_served_while_the_serving_engines_nats_loop_is_stuck(nats_url: str) -> None:
    """Streaming runs on a loop of its own: with A's NATS loop held up, B still loads from A over its kept
    connection (it used to wait on that very loop); and with A's stream loop held up, A still answers on NATS."""
    async with engines(nats_url, b_config={"p2p_stream_connections": 1}) as (a, kv_a, b, kv_b):
        first = await computed_at_a(a, kv_a, b, seed=10)
        second = await computed_at_a(a, kv_a, b, seed=11)
        assert await loads_right(b, kv_b, first)  # B's one kept connection to A
        release = threading.Event()
        assert a.nats_loop is not None
        a.nats_loop.call_soon(release.wait, WAIT_S * 4)  # A's NATS loop stuck (until the test lets it go)
        try:
            assert await loads_right(b, kv_b, second)
        finally:
            release.set()
        assert b.storage.stats["p2p_read_failed"] == 0

        stream_loop = a.mesh.peer_server.loop
        assert stream_loop is not None and stream_loop is not a.nats_loop.loop
        stuck = threading.Event()
        stream_loop.call_soon_threadsafe(stuck.wait, WAIT_S * 4)
        try:
            nc = await bus.connect(nats_url, "prober")
            try:
                reply = await bus.request(nc, Subjects.health(a.mesh.agent.path), protocol.HealthRequest(),
                                          protocol.HealthReply, WAIT_S)
                assert reply.status == "ok"
            finally:
                await nc.close()
        finally:
            stuck.set()
