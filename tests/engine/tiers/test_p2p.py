"""P2P hits (issue 27): engines on a real NATS with a real controller and no store at all, each serving its CPU
tier to its peers (enable_p2p). An engine that misses asks the controller which peers serve the prefix and
streams the chunks from their CPU tiers; the KV it loads is checked against an oracle in which every block's KV
depends on the KV of the blocks before it.

Who serves (issue 36): each key's holder of record, the first member of the domain whose admission of it the
controller applied; never a later member holding other bytes, a worker a client's PD hint names, one whose
registration names another domain than its principal's, or one whose chunk failed the loader's check."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import AsyncIterator, Iterator

import pytest
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.tiers.peer import PeerTier, PeerWorker
from kvmesh.shared.messaging.credentials import MeshCredentials, local_mesh_dir
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import PEER, Principal
from kvmesh.shared.wire.keys import ChunkSpan, KeyParams

from support.controller import FakeEngineWorker, running_controller, started
from support.engine import CHUNK, PagedKV, engine_config, random_tokens
from support.kv_oracle import ContextForward
from support.waiting import WAIT_S, wait_until, wait_until_async

PARAMS = KeyParams(model="test-model", kv_format="")
BLOCKS = 64
SCRATCH = list(range(BLOCKS - 16, BLOCKS))  # the oracle's own blocks
TOKENS = 5 * CHUNK + 7  # five full chunks and a partial one


@pytest.fixture
def nats_url() -> Iterator[str]:
    server = EmbeddedNats().start()
    yield server.url
    server.stop()


@pytest.fixture
async def controller(nats_url: str) -> AsyncIterator[None]:
    async with running_controller(nats_url):
        yield


def p2p_engine(url: str, instance: str, kv: PagedKV, **overrides: object) -> CacheEngine:
    engine = build_engine(engine_config(nats_url=url, lmcache_instance_id=instance, enable_p2p=True, **overrides),
                          PARAMS, kv.layout)
    assert engine.wait_connected(WAIT_S), f"engine {instance} did not reach NATS"
    wait_until(lambda: engine.storage.lower(PEER) is not None and engine.mesh.agent.started,
               what=f"{instance}'s peer tier")
    return engine


@contextlib.asynccontextmanager
async def two_engines(url: str, a_name: str, b_name: str, **b_overrides: object
                      ) -> AsyncIterator[tuple[CacheEngine, PagedKV, CacheEngine, PagedKV]]:
    """Engines A and B with P2P on the mesh at `url`, each over its own random paged KV; both closed after."""
    kv_a, kv_b = PagedKV(num_blocks=BLOCKS, seed=1), PagedKV(num_blocks=BLOCKS, seed=2)
    a = await asyncio.to_thread(p2p_engine, url, a_name, kv_a)
    try:
        b = await asyncio.to_thread(p2p_engine, url, b_name, kv_b, **b_overrides)
        try:
            yield a, kv_a, b, kv_b
        finally:
            await asyncio.to_thread(b.close)
    finally:
        await asyncio.to_thread(a.close)


def computed(engine: CacheEngine, kv: PagedKV, tokens: list[int], salt: str = "") -> list[int]:
    """vLLM's forward over `tokens` into fresh blocks of `kv`, then the engine stores them; the blocks. A `salt`
    makes other KV for the same tokens (a member holding wrong bytes under their keys)."""
    blocks = list(range(-(-len(tokens) // kv.block_size)))
    ContextForward(kv, SCRATCH).run(tokens, blocks, 0, len(tokens), salt)
    token_api.store(engine, torch.tensor(tokens), **kv.kv(slots_of(blocks, len(tokens), kv.block_size)))
    return blocks


def slots_of(blocks: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    return torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(num_tokens)])


async def prefix_held(engine: CacheEngine, spans: list[ChunkSpan], instance: str = "", worker: str = "") -> int:
    """The worker's lookup of `spans` as its scheduler asks it (`worker` of `instance`: a request's PD hint), on its
    NATS loop, from a thread: the test's own loop runs the controller."""
    return await asyncio.to_thread(engine.nats_loop.call, engine.lookup_and_prefetch(spans, instance, worker), WAIT_S,
                                   default=-1)


async def finds_all(engine: CacheEngine, tokens: list[int]) -> bool:
    return await asyncio.to_thread(token_api.lookup, engine, tokens) == len(tokens)


def loaded(engine: CacheEngine, kv: PagedKV, tokens: list[int], blocks: list[int]) -> int:
    """Retrieve `tokens` into `blocks` of `kv`; the tokens loaded."""
    mask = token_api.retrieve(engine, torch.tensor(tokens), **kv.kv(slots_of(blocks, len(tokens), kv.block_size)))
    return int(mask.sum())


async def test_an_engine_that_misses_loads_the_prefix_from_a_peers_cpu_tier(nats_url: str, controller: None) -> None:
    async with two_engines(nats_url, "peer-a", "peer-b") as (a, kv_a, b, kv_b):
        tokens = random_tokens(TOKENS, seed=7).tolist()
        await asyncio.to_thread(computed, a, kv_a, tokens)
        # B's own tiers hold nothing; the controller learns A's admissions, then B's lookup finds them at A
        await wait_until_async(lambda: finds_all(b, tokens),
                               what="B's lookup to find A's chunks")
        blocks = list(range(10, 10 + -(-TOKENS // kv_b.block_size)))
        assert await asyncio.to_thread(loaded, b, kv_b, tokens, blocks) == TOKENS
        assert ContextForward(kv_b, SCRATCH).holds(tokens, blocks, TOKENS)  # every block as vLLM computes it
        chunks = -(-TOKENS // CHUNK)
        assert b.storage.stats[f"fetched_{PEER}"] == chunks and a.storage.stats["p2p_served_chunks"] == chunks
        assert b.storage.stats["p2p_read_failed"] == 0
        # the chunks are B's own now: a second load asks no peer
        assert await asyncio.to_thread(loaded, b, kv_b, tokens, blocks) == TOKENS
        assert a.storage.stats["p2p_served_chunks"] == chunks


async def test_a_peer_that_dropped_the_chunks_or_died_is_a_miss_never_an_error(nats_url: str,
                                                                              controller: None) -> None:
    """After B's lookup named A, A evicts the chunks: B's load is a miss (A answers "not found"). Then A is gone
    altogether: B's load is a miss again, bounded by its timeouts, and B keeps serving."""
    # B keeps nothing in its CPU tier: each load asks the peer again
    async with two_engines(nats_url, "peer-a", "peer-b", local_cpu=False) as (a, kv_a, b, kv_b):
        tokens = random_tokens(TOKENS, seed=8).tolist()
        await asyncio.to_thread(computed, a, kv_a, tokens)
        await wait_until_async(lambda: finds_all(b, tokens), what="B's lookup")
        assert token_api.clear(a) > 0
        blocks = list(range(10, 10 + -(-TOKENS // kv_b.block_size)))
        assert await asyncio.to_thread(loaded, b, kv_b, tokens, blocks) == 0
        assert b.storage.stats["p2p_read_missed"] == a.storage.stats["p2p_served_misses"] >= 1  # a batch's reads

        await asyncio.to_thread(computed, a, kv_a, tokens)
        await wait_until_async(lambda: finds_all(b, tokens), what="B's lookup")
        await asyncio.to_thread(a.close)
        assert await asyncio.to_thread(loaded, b, kv_b, tokens, blocks) == 0
        assert b.storage.stats["p2p_read_failed"] >= 1


def engine_in_domain(mesh: LocalMesh, instance: str, domain: str, kv: PagedKV) -> CacheEngine:
    credentials = MeshCredentials(local_mesh_dir(int(mesh.nats_url.rsplit(":", 1)[1])))
    path = Principal.engine(instance).path
    credentials.ensure(path, domain=domain)
    assert credentials.reload_server()
    return p2p_engine(mesh.nats_url, instance, kv, nats_credentials=str(credentials.file(path)))


async def test_p2p_stays_inside_a_sharing_domain(nats_mesh: LocalMesh) -> None:
    """red-b loads red-a's chunks; blue-c, of another domain, learns nothing from the controller, and a stream
    request of its own to red-a is refused by NATS (counted): red-a serves it nothing. A /move from red-a to
    blue-c is refused (409)."""
    mesh = nats_mesh
    kvs = {name: PagedKV(num_blocks=BLOCKS, seed=seed) for seed, name in enumerate(("red-a", "red-b", "blue-c"))}
    async with running_controller(mesh.nats_url) as (_, client):
        engines = {name: await asyncio.to_thread(engine_in_domain, mesh, name, domain, kvs[name])
                   for name, domain in (("red-a", "red"), ("red-b", "red"), ("blue-c", "blue"))}
        try:
            tokens = random_tokens(TOKENS, seed=9).tolist()
            red_a = engines["red-a"]
            await asyncio.to_thread(computed, red_a, kvs["red-a"], tokens)
            await wait_until_async(lambda: finds_all(engines["red-b"], tokens),
                                   what="red-b's lookup")
            assert await asyncio.to_thread(token_api.lookup, engines["blue-c"], tokens) == 0

            blue = engines["blue-c"]
            key = red_a.hasher.keys(torch.tensor(tokens))[0]  # even knowing red-a's key
            holder = PeerWorker("red-a", red_a.worker_id)
            own = blue.storage.lower(PEER)  # asks on its own domain's subjects: nobody of red hears them
            forged = PeerTier(blue.nats_loop.nc, "red", blue.worker_id, blue.mesh.agent.path, blue.storage.stats,
                              request_timeout=2.0)  # asks on red's: NATS refuses
            assert isinstance(own, PeerTier)
            slot = blue.cpu.allocate()
            assert slot is not None
            try:
                for peers in (own, forged):
                    assert blue.nats_loop.call(peers.get_from(holder, key, slot.chunk_buffer()), WAIT_S,
                                               default="timeout") is None
            finally:
                slot.release()
            assert blue.storage.stats["p2p_refused"] == 1 and blue.nats_loop.nc.permission_violations >= 1
            assert red_a.storage.stats["p2p_served_chunks"] == 0 and red_a.storage.stats["p2p_served_misses"] == 0
            moved = await client.post("/move", json={"old_position": ["red-a", "LocalCPUBackend"],
                                                     "new_position": ["blue-c", "LocalCPUBackend"],
                                                     "tokens": tokens})
            assert moved.status_code == 409 and "different sharing domains" in moved.json()["detail"], moved.text
        finally:
            for engine in engines.values():
                await asyncio.to_thread(engine.close)


async def test_move_between_instances_streams_the_chunks_and_lookup_then_names_the_target(nats_url: str) -> None:
    """/move from A's CPU tier to B's: B's workers stream the chunks from A (P2P), /lookup lists B, and B loads
    them from its own CPU tier (no peer read). Without should_copy they then leave A."""
    async with running_controller(nats_url) as (_, client):
        async with two_engines(nats_url, "peer-a", "peer-b") as (a, kv_a, b, kv_b):
            tokens = random_tokens(TOKENS, seed=10).tolist()
            await asyncio.to_thread(computed, a, kv_a, tokens)

            async def layout() -> dict:
                response = await client.post("/lookup", json={"tokens": tokens})
                return response.json()["layout_info"]

            await wait_until_async(lambda: _is(layout(), {"peer-a": ["LocalCPUBackend", TOKENS]}), what="A listed")
            response = await client.post("/move", json={"old_position": ["peer-a", "LocalCPUBackend"],
                                                         "new_position": ["peer-b", "LocalCPUBackend"],
                                                         "tokens": tokens, "should_copy": False})
            assert response.status_code == 200 and response.json()["num_tokens"] == TOKENS, response.text
            await wait_until_async(lambda: _is(layout(), {"peer-b": ["LocalCPUBackend", TOKENS]}),
                                   what="only B listed after the move")
            chunks = -(-TOKENS // CHUNK)
            assert a.storage.stats["p2p_served_chunks"] == chunks and len(a.cpu) == 0
            assert b.storage.stats[f"fetched_{PEER}"] == chunks  # the move's reads count as P2P reads
            blocks = list(range(10, 10 + -(-TOKENS // kv_b.block_size)))
            assert await asyncio.to_thread(loaded, b, kv_b, tokens, blocks) == TOKENS
            assert ContextForward(kv_b, SCRATCH).holds(tokens, blocks, TOKENS)
            assert a.storage.stats["p2p_served_chunks"] == chunks  # loaded from B's own CPU tier
            assert b.storage.stats[f"fetched_{PEER}"] == chunks

            workers = (await client.post("/query_worker_info", json={"instance_id": "peer-b"})).json()
            assert workers["worker_infos"][0]["peer_init_url"] == b.mesh.peer_server.endpoint
            refused = await client.post("/move", json={"old_position": ["peer-b", "LocalCPUBackend"],
                                                       "new_position": ["peer-b", "LocalDiskBackend"],
                                                       "tokens": tokens})
            assert refused.status_code == 404  # B has no disk tier


async def _is(value: object, expected: object) -> bool:
    return await value == expected  # type: ignore[misc]


async def test_a_pd_consumer_waits_for_the_producer_its_request_names_and_loads_what_the_controller_names(
        nats_url: str) -> None:
    """Prefill/decode: the consumer's lookup carries the producer's worker (adapter/pd.py), client input. It never
    names who serves: with no controller on the mesh the hint promises nothing. With one, the consumer's lookup
    right after the producer stored (its admissions may still be on their way) waits for the controller to name
    the chunks' holder, and loads them, checked like any chunk."""
    async with two_engines(nats_url, "prefill-a", "decode-b") as (a, kv_a, b, kv_b):
        tokens = random_tokens(TOKENS, seed=11).tolist()
        chain = b.hasher.chain(torch.tensor(tokens))
        spans = b.chunk_spans([span.key for span in chain], TOKENS)
        blocks = list(range(10, 10 + -(-TOKENS // kv_b.block_size)))
        await asyncio.to_thread(computed, a, kv_a, tokens)
        assert await prefix_held(b, spans, "prefill-a", a.worker_id) == 0
        assert await asyncio.to_thread(loaded, b, kv_b, tokens, blocks) == 0  # nothing was read from A
        assert a.storage.stats["p2p_served_chunks"] == 0

        async with running_controller(nats_url) as (service, _):
            await wait_until_async(lambda: all(service.core.table.producer(e.worker_id) for e in (a, b)),
                                   what="A and B registered")
            other = random_tokens(TOKENS, seed=12).tolist()
            other_spans = b.chunk_spans([span.key for span in b.hasher.chain(torch.tensor(other))], TOKENS)
            await asyncio.to_thread(computed, a, kv_a, other)
            assert await prefix_held(b, other_spans, "prefill-a", a.worker_id) == TOKENS
            assert await asyncio.to_thread(loaded, b, kv_b, other, blocks) == TOKENS
            assert ContextForward(kv_b, SCRATCH).holds(other, blocks, TOKENS)
            assert a.storage.stats["p2p_served_chunks"] == -(-TOKENS // CHUNK)


async def test_a_pd_consumer_waits_for_the_producers_partial_last_chunk_too(nats_url: str) -> None:
    """The producer admits the prompt's partial last chunk (save_unfull_chunk) after its full ones: a hinted lookup
    that already sees the full chunks named waits for that last one too, and loads the whole prompt (CI, stop 43:
    a consumer loaded 256 of 450 tokens, its wait covered the full chunks only)."""
    async with running_controller(nats_url) as (service, client):
        async with two_engines(nats_url, "prefill-a", "decode-b", pd_hint_wait_secs=WAIT_S) as (a, kv_a, b, kv_b):
            await wait_until_async(lambda: all(service.core.table.producer(e.worker_id) for e in (a, b)),
                                   what="A and B registered")
            tokens = random_tokens(TOKENS, seed=15).tolist()
            full = TOKENS // CHUNK * CHUNK
            spans = b.chunk_spans([span.key for span in b.hasher.chain(torch.tensor(tokens))], TOKENS)
            await asyncio.to_thread(computed, a, kv_a, tokens[:full])
            await wait_until_async(lambda: lists(client, tokens[:full], "prefill-a"), what="A's full chunks listed")
            asked = service.core.peer_lookups("peer") + service.core.peer_lookups("none")
            lookup = asyncio.create_task(prefix_held(b, spans, "prefill-a", a.worker_id))
            await wait_until_async(lambda: service.core.peer_lookups("peer") + service.core.peer_lookups("none")
                                   > asked, what="B's hinted lookup asked the controller")
            await asyncio.to_thread(computed, a, kv_a, tokens)  # the partial last chunk, admitted later
            assert await lookup == TOKENS
            blocks = list(range(10, 10 + -(-TOKENS // kv_b.block_size)))
            assert await asyncio.to_thread(loaded, b, kv_b, tokens, blocks) == TOKENS
            assert ContextForward(kv_b, SCRATCH).holds(tokens, blocks, TOKENS)


def p2p_engines(url: str, names: tuple[str, ...], **overrides: object) -> dict[str, tuple[CacheEngine, PagedKV]]:
    """P2P engines started one after the other (each registered before the next starts), each over its own KV."""
    engines: dict[str, tuple[CacheEngine, PagedKV]] = {}
    for seed, name in enumerate(names):
        kv = PagedKV(num_blocks=BLOCKS, seed=seed)
        engines[name] = (p2p_engine(url, name, kv, **overrides.get(name, {})), kv)  # type: ignore[arg-type]
    return engines


async def lists(client: object, tokens: list[int], instance: str) -> bool:
    """Whether the controller's /lookup says `instance` holds every chunk of `tokens`."""
    response = await client.post("/lookup", json={"tokens": tokens})  # type: ignore[attr-defined]
    return response.json()["layout_info"].get(instance, [None, 0])[1] == len(tokens)


async def test_the_first_member_to_admit_a_chain_serves_it_never_a_later_one_holding_other_bytes(
        nats_mesh: LocalMesh) -> None:
    """Issue 36, finding 1. M, a member of the domain that holds wrong KV, registers first (the lowest slot) and
    claims the keys of a prompt A computed first: C loads A's KV, and a client's PD hint naming M changes nothing.
    What M can still do (docs/security.md): pre-plant a prompt nobody holds yet, which C then loads from M until M
    drops it; then from A."""
    url = str(nats_mesh.nats_url)
    async with running_controller(url) as (_, client):
        engines = await asyncio.to_thread(p2p_engines, url, ("m", "a", "c"), c={"local_cpu": False})
        (m, kv_m), (a, kv_a), (c, kv_c) = engines["m"], engines["a"], engines["c"]
        try:
            chunks = -(-TOKENS // CHUNK)
            blocks = list(range(10, 10 + -(-TOKENS // kv_c.block_size)))
            tokens = random_tokens(TOKENS, seed=13).tolist()
            await asyncio.to_thread(computed, a, kv_a, tokens)
            await wait_until_async(lambda: lists(client, tokens, "a"), what="A's chunks listed")
            await asyncio.to_thread(computed, m, kv_m, tokens, "not this model")  # M: other KV, same keys
            await wait_until_async(lambda: lists(client, tokens, "m"), what="M's chunks listed")
            assert await asyncio.to_thread(loaded, c, kv_c, tokens, blocks) == TOKENS
            assert ContextForward(kv_c, SCRATCH).holds(tokens, blocks, TOKENS)
            assert a.storage.stats["p2p_served_chunks"] == chunks and m.storage.stats["p2p_served_chunks"] == 0

            spans = c.chunk_spans([span.key for span in c.hasher.chain(torch.tensor(tokens))], TOKENS)
            assert await prefix_held(c, spans, "m", m.worker_id) == TOKENS
            assert await asyncio.to_thread(loaded, c, kv_c, tokens, blocks) == TOKENS  # (C keeps nothing: asks again)
            assert ContextForward(kv_c, SCRATCH).holds(tokens, blocks, TOKENS)
            assert a.storage.stats["p2p_served_chunks"] == 2 * chunks and m.storage.stats["p2p_served_chunks"] == 0

            planted = random_tokens(TOKENS, seed=14).tolist()  # the residual: M admits it before anyone else
            await asyncio.to_thread(computed, m, kv_m, planted, "not this model")
            await wait_until_async(lambda: lists(client, planted, "m"), what="M's planted chunks listed")
            await asyncio.to_thread(computed, a, kv_a, planted)
            await wait_until_async(lambda: lists(client, planted, "a"), what="A's chunks listed")
            assert await asyncio.to_thread(loaded, c, kv_c, planted, blocks) == TOKENS
            assert not ContextForward(kv_c, SCRATCH).holds(planted, blocks, TOKENS)  # M's bytes: pre-planted
            assert m.storage.stats["p2p_served_chunks"] == chunks
            assert token_api.clear(m) > 0
            await wait_until_async(lambda: _not(listed(client, planted, "m")), what="M's chunks gone")
            assert await asyncio.to_thread(loaded, c, kv_c, planted, blocks) == TOKENS
            assert ContextForward(kv_c, SCRATCH).holds(planted, blocks, TOKENS)
        finally:
            for engine, _ in engines.values():
                await asyncio.to_thread(engine.close)


async def listed(client: object, tokens: list[int], instance: str) -> bool:
    response = await client.post("/lookup", json={"tokens": tokens})  # type: ignore[attr-defined]
    return instance in response.json()["layout_info"]


async def _not(value: object) -> bool:
    return not await value  # type: ignore[misc]


async def test_a_pd_hint_naming_no_live_instance_promises_nothing(nats_mesh: LocalMesh) -> None:
    """Issue 36, finding 6: a consumer's request whose kv_transfer_params name a worker that is not a live peer
    (or one that holds none of the prompt) is a miss at once, not a promised hit that then fails its loads."""
    url = str(nats_mesh.nats_url)
    async with running_controller(url):
        async with two_engines(url, "a", "c") as (a, kv_a, c, kv_c):
            tokens = random_tokens(TOKENS, seed=15).tolist()  # nobody computed it
            spans = c.chunk_spans([span.key for span in c.hasher.chain(torch.tensor(tokens))], TOKENS)
            for instance, worker in (("ghost", "ghost"), ("a", a.worker_id)):
                assert await prefix_held(c, spans, instance, worker) == 0
            blocks = list(range(10, 10 + -(-TOKENS // kv_c.block_size)))
            assert await asyncio.to_thread(loaded, c, kv_c, tokens, blocks) == 0
            assert c.storage.stats["p2p_read_failed"] == c.storage.stats["p2p_read_missed"] == 0  # none tried


async def test_a_peer_whose_chunk_fails_its_check_is_not_asked_again_for_that_chain(nats_mesh: LocalMesh) -> None:
    """M admitted the prompt first, but its first chunk fails the checksum C verifies: C's load ends there, and
    C's next lookup of that chain excludes M, so the controller names A, whose KV C loads."""
    url = str(nats_mesh.nats_url)
    async with running_controller(url) as (_, client):
        engines = await asyncio.to_thread(p2p_engines, url, ("m", "a", "c"), c={"local_cpu": False})
        (m, kv_m), (a, kv_a), (c, kv_c) = engines["m"], engines["a"], engines["c"]
        try:
            tokens = random_tokens(TOKENS, seed=16).tolist()
            await asyncio.to_thread(computed, m, kv_m, tokens)
            await wait_until_async(lambda: lists(client, tokens, "m"), what="M's chunks listed")
            await asyncio.to_thread(computed, a, kv_a, tokens)
            await wait_until_async(lambda: lists(client, tokens, "a"), what="A's chunks listed")
            first = m.hasher.keys(torch.tensor(tokens))[0]
            ref = m.cpu.acquire(first)
            assert ref is not None
            m.cpu.note_checksum(ref, 12345)  # what M sends with the chunk's bytes: they fail it
            ref.release()
            blocks = list(range(10, 10 + -(-TOKENS // kv_c.block_size)))
            assert await asyncio.to_thread(loaded, c, kv_c, tokens, blocks) == 0
            served_by_m = m.storage.stats["p2p_served_chunks"]  # the failed chunk and the reads beside it
            assert await asyncio.to_thread(loaded, c, kv_c, tokens, blocks) == TOKENS
            assert ContextForward(kv_c, SCRATCH).holds(tokens, blocks, TOKENS)
            assert a.storage.stats["p2p_served_chunks"] == -(-TOKENS // CHUNK)
            assert m.storage.stats["p2p_served_chunks"] == served_by_m  # never asked again for that chain
            assert c.storage.stats["p2p_read_failed"] == 1 and c.storage.stats["p2p_distrusted"] == 1
        finally:
            for engine, _ in engines.values():
                await asyncio.to_thread(engine.close)


async def test_a_registration_naming_another_domain_than_its_principals_is_refused_and_counted(
        nats_mesh: LocalMesh) -> None:
    """Issue 36, finding 2. An engine principal of domain blue registers a P2P worker saying "default" (first: the
    lowest slot) and claims the default keys of a prompt A holds. The controller takes each worker's domain from
    the domains map (the stores' map), so it refuses that registration and counts it: /lookup never lists the
    liar, and default C loads A's KV. The same principal registering as blue is taken, and serves no default
    engine."""
    url = str(nats_mesh.nats_url)
    assert nats_mesh.credentials is not None
    nats_mesh.credentials.ensure(Principal.engine("blue-liar").path, Principal.engine("blue-honest").path,
                                 domain="blue")
    assert nats_mesh.credentials.reload_server()
    async with running_controller(url) as (service, client):
        like_a = dict(chunk_size=CHUNK, model=PARAMS.model, kv_format=PagedKV().layout.chunk_format(), p2p=True)
        liar = FakeEngineWorker(url, "blue-liar", **like_a)  # says "default"
        honest = FakeEngineWorker(url, "blue-honest", domain="blue", **like_a)
        async with started(liar, honest):
            table = service.core.table
            await wait_until_async(lambda: table.stats.registrations_refused["domain"] or table.producer(
                liar.worker_id), what="the liar's registration handled")
            await wait_until_async(lambda: table.producer(honest.worker_id), what="blue-honest registered")
            engines = await asyncio.to_thread(p2p_engines, url, ("a", "c"))
            (a, kv_a), (c, kv_c) = engines["a"], engines["c"]
            try:
                tokens = random_tokens(TOKENS, seed=17).tolist()
                await asyncio.to_thread(computed, a, kv_a, tokens)
                for worker in (liar, honest):
                    worker.store(tokens)  # the keys of default engines (no secret), as A holds them
                await wait_until_async(lambda: table.stats.registrations_refused["domain"] or lists(
                    client, tokens, "blue-liar"), what="the liar refused, or its claims indexed")
                await wait_until_async(lambda: finds_all(c, tokens), what="C's lookup")
                blocks = list(range(10, 10 + -(-TOKENS // kv_c.block_size)))
                assert await asyncio.to_thread(loaded, c, kv_c, tokens, blocks) == TOKENS
                assert ContextForward(kv_c, SCRATCH).holds(tokens, blocks, TOKENS)
                assert a.storage.stats["p2p_served_chunks"] == -(-TOKENS // CHUNK)
                layout = (await client.post("/lookup", json={"tokens": tokens})).json()["layout_info"]
                assert "a" in layout and "blue-liar" not in layout
                refused = table.stats.registrations_refused["domain"]  # each time the liar announces itself
                assert refused >= 1 and table.producer(liar.worker_id) is None
                assert table.producer(honest.worker_id).domain == "blue"  # taken in its own domain
                metrics = (await client.get("/metrics")).text
                assert re.search(r'kvmesh_controller_registrations_refused_total\{reason="domain"\} [1-9]', metrics)
            finally:
                for engine, _ in engines.values():
                    await asyncio.to_thread(engine.close)
