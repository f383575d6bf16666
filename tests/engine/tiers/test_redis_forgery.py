"""Authenticated Redis values (issue 24, finding 4), on a real redis-server: whoever can write under the key
prefix but lacks the engines' secret cannot make them load its bytes (planted, replaced, moved from another
deployment's keys, or left by an older KVMesh), nor keep a chunk unevictable or uncleared with forged pin or
owner entries; honest round trips still work, and the secret comes from `remote_auth_secret_file`, else the
sharing domain's secret in the engine's credentials file.

The attacker is KVMesh's own tier run with another secret: it writes values and entries in exactly the format
the engines use (a valid header, the right checksum over its own bytes), only its keys are wrong.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import EngineConfig, load_engine_config
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.mesh.domain import engine_credentials_file
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.redis import RedisTier
from kvmesh.services.engine.tiers.redis_values import resolve_auth
from kvmesh.shared import protocol
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.credentials import MeshCredentials, local_mesh_dir, provision
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import REMOTE, Principal
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KeyParams
from kvmesh.shared.wire.redis_keys import VALUE_MAGIC, RedisAuth
from kvmesh.shared.wire.redis_url import parse_redis_url

from support.redis_server import RedisServer
from support.engine import PagedKV, engine_config, random_tokens
from support.redis_tier import TIER_LOG, chunk, get, put
from support.waiting import WAIT_S, wait_until

SECRET = b"the engines' shared secret, 32 b"
ATTACKER_SECRET = b"a secret that is not the engines'"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def make_tier(server: RedisServer, caller: str = "engine.a.a", secret: bytes | None = SECRET,
              **options: object) -> RedisTier:
    options = {"timeout": WAIT_S / 3, "retry_interval": 0.0, **options}
    return RedisTier(parse_redis_url(server.url), caller, auth=RedisAuth(secret, "test"),  # type: ignore[arg-type]
                     **options)


def evil_twin(meta: protocol.ChunkMeta, seed: int = 999) -> tuple[protocol.ChunkMeta, bytes]:
    """Other bytes under `meta`'s key, with a meta (and so a header) whose checksum is right for them."""
    data = random.Random(seed).randbytes(meta.nbytes)
    return protocol.ChunkMeta(**{**meta.__dict__, "checksum": chunk_file.checksum(data)}), data


async def test_an_honest_round_trip_works_and_redis_holds_only_ciphertext(redis_server: RedisServer) -> None:
    writer, reader = make_tier(redis_server, "engine.one.one"), make_tier(redis_server, "engine.two.two")
    try:
        meta, data = chunk(1, nbytes=2 * 1024 * 1024 + 3)
        assert await put(writer, meta, data)
        assert await get(reader, meta) == data  # another engine with the same secret
        with redis_server.client() as client:
            value = client.get(writer.chunk_key(meta.key))
        assert value[:len(VALUE_MAGIC)] == VALUE_MAGIC
        # encrypted at rest: no 32-byte run of the chunk's bytes is in what Redis holds
        assert not any(data[at:at + 32] in value for at in range(0, len(data) - 32, len(data) // 64))
        assert len(value) > len(data) and value.count(0) < len(value) // 128  # not zeros either
        assert await reader.pin([meta.key], [32]) == 32 and await writer.unpin([meta.key], [32]) == 32
        assert await writer.clear() == 32 and await reader.contains([meta.key]) == 0
        assert reader.values_rejected == 0 and reader.entries_rejected == 0
    finally:
        await writer.close()
        await reader.close()


@pytest.mark.parametrize("held", [False, True], ids=["pre-planted", "replaced"])
@pytest.mark.parametrize("our_key_id", [True, False], ids=["posing-as-ours", "its-own-key-id"])
async def test_a_forged_value_is_a_miss(redis_server: RedisServer, held: bool, our_key_id: bool,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """A value with a valid header and the right checksum over other bytes, under a key nobody stored yet or in
    place of the engines' value: a miss, one WARNING, counted; the next honest put is served. Posing as ours (our
    key id copied from one of our values) it fails the MAC and is deleted; under its own key id it is another
    secret's value, left alone on reads (engines of two secrets on one prefix must not delete each other's) and
    replaced by the honest put."""
    tier, attacker = make_tier(redis_server), make_tier(redis_server, "engine.evil.evil", ATTACKER_SECRET)
    try:
        meta, data = chunk(2)
        forged, forged_data = evil_twin(meta)
        if held:
            assert await put(tier, meta, data)
            assert await attacker.remove([meta.key]) == 1
        assert await put(attacker, forged, forged_data)
        name = tier.chunk_key(meta.key)
        if our_key_id:
            with redis_server.client() as client:
                client.setrange(name, len(VALUE_MAGIC), tier.auth.key_id)
        caplog.set_level(logging.WARNING, TIER_LOG)
        out = bytearray(meta.nbytes)
        assert await tier.get_into(meta.key, ChunkBuffer(memoryview(out))) is None
        assert bytes(out) != forged_data  # never the forged bytes (decrypting them under our key gives noise)
        with redis_server.client() as client:
            assert bool(client.exists(name)) is not our_key_id  # deleted only when it fails our tag
        warnings = [r for r in caplog.records if r.name == TIER_LOG and r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert ("tag mismatch" if our_key_id else "another secret") in warnings[0].getMessage()
        stats = (await tier.stats())[0].details
        assert (stats["values_rejected"], stats["values_foreign"]) == ((1, 0) if our_key_id else (0, 1))
        assert stats["authenticated"] is True
        assert await put(tier, meta, data) and await get(tier, meta) == data
    finally:
        await tier.close()
        await attacker.close()


async def test_a_value_moved_from_another_key_is_a_miss(redis_server: RedisServer) -> None:
    """Another deployment's valid value of the same chunk (same header key, its own bytes), copied under this
    prefix, is a miss, even with the same secret: the MAC covers the key name. So is a value of another chunk."""
    tier, other = make_tier(redis_server), make_tier(redis_server, key_prefix="other-deployment")
    try:
        meta, data = chunk(3)
        theirs, their_data = evil_twin(meta)
        second, second_data = chunk(4)
        assert await put(other, theirs, their_data) and await put(tier, second, second_data)
        with redis_server.client() as client:
            client.set(tier.chunk_key(meta.key), client.get(other.chunk_key(meta.key)))
        assert await get(tier, meta) is None
        assert await tier.contains([meta.key]) == 0
        with redis_server.client() as client:
            client.set(tier.chunk_key(meta.key), client.get(tier.chunk_key(second.key)))
        assert await get(tier, meta) is None and await tier.contains([meta.key]) == 0
        assert await get(other, theirs) == their_data and await get(tier, second) == second_data
    finally:
        await tier.close()
        await other.close()


async def test_a_value_of_the_old_format_is_a_miss_and_deleted(redis_server: RedisServer) -> None:
    """Values written before values carried a MAC (header and bytes only) are misses: old caches are cold once."""
    tier = make_tier(redis_server)
    try:
        meta, data = chunk(5)
        with redis_server.client() as client:
            client.set(tier.chunk_key(meta.key), chunk_file.encode_header(meta) + data)
            client.set(tier.keys.of_chunk(meta.key)[1], 3)  # an old pin count
        assert await get(tier, meta) is None
        with redis_server.client() as client:
            assert not client.exists(*tier.keys.of_chunk(meta.key))
        assert await put(tier, meta, data) and await get(tier, meta) == data
        with redis_server.client() as client:  # an old pin count beside a current value: no pin, no failure
            client.set(tier.keys.of_chunk(meta.key)[1], 3)
            client.persist(tier.chunk_key(meta.key))
        assert await tier.unpin([meta.key], [32]) == 0
        with redis_server.client() as client:
            assert 0 < client.pttl(tier.chunk_key(meta.key))  # no pin holds it: volatile again
        assert await tier.pin([meta.key], [32]) == 32 and await tier.unpin([meta.key], [32]) == 32
        with redis_server.client() as client:
            assert 0 < client.pttl(tier.chunk_key(meta.key))
        assert await tier.contains([meta.key]) == 1  # Redis was never taken for down
    finally:
        await tier.close()


async def test_forged_pins_keep_no_chunk_unevictable(redis_server: RedisServer) -> None:
    """Pins written without the secret do not count: after the engines' last unpin the chunk is volatile (and
    evictable) again; a chunk only a forged pin holds is made volatile by the next unpin, which counts none."""
    tier, attacker = make_tier(redis_server), make_tier(redis_server, "engine.evil.evil", ATTACKER_SECRET)
    try:
        (a, da), (b, db) = chunk(10), chunk(11)
        assert await put(tier, a, da) and await put(tier, b, db)
        assert await tier.pin([a.key], [32]) == 32
        for _ in range(3):
            assert await attacker.pin([a.key, b.key], [32, 32]) == 64
        with redis_server.client() as client:
            assert client.pttl(tier.chunk_key(a.key)) == -1 and client.pttl(tier.chunk_key(b.key)) == -1
        assert await tier.unpin([a.key], [32]) == 32  # the one honest pin
        with redis_server.client() as client:
            assert 0 < client.pttl(tier.chunk_key(a.key)), "forged pins kept the chunk unevictable"
        assert await tier.unpin([b.key], [32]) == 0  # no honest pin to take back
        with redis_server.client() as client:
            assert 0 < client.pttl(tier.chunk_key(b.key)), "a forged pin kept the chunk unevictable"
            for key in (a.key, b.key):
                assert not client.exists(tier.keys.of_chunk(key)[1])  # the forged entries are gone
        assert await tier.unpin([a.key], [32]) == 0
        assert tier.entries_rejected >= 6
        assert await get(tier, a) == da and await get(tier, b) == db
    finally:
        await tier.close()
        await attacker.close()


async def test_a_pin_moved_from_another_chunk_does_not_count(redis_server: RedisServer) -> None:
    tier = make_tier(redis_server)
    try:
        (a, da), (b, db) = chunk(12), chunk(13)
        assert await put(tier, a, da) and await put(tier, b, db)
        assert await tier.pin([a.key], [32]) == 32
        with redis_server.client() as client:
            pins_a, pins_b = tier.keys.of_chunk(a.key)[1], tier.keys.of_chunk(b.key)[1]
            client.copy(pins_a, pins_b, replace=True)  # chunk a's valid pin, now under chunk b
            client.persist(tier.chunk_key(b.key))
        assert await tier.unpin([b.key], [32]) == 0
        with redis_server.client() as client:
            assert 0 < client.pttl(tier.chunk_key(b.key)) and client.pttl(tier.chunk_key(a.key)) == -1
        assert await tier.unpin([a.key], [32]) == 32
    finally:
        await tier.close()


async def test_forged_owners_do_not_keep_a_chunk_from_being_cleared(redis_server: RedisServer) -> None:
    """A claim written without the secret is no claim: the engines' last clear deletes the chunk."""
    one, two = make_tier(redis_server, "engine.one.one"), make_tier(redis_server, "engine.two.two")
    attacker = make_tier(redis_server, "engine.evil.evil", ATTACKER_SECRET)
    try:
        (a, da), (b, db) = chunk(20), chunk(21)
        for tier, items in ((one, [(a, da), (b, db)]), (two, [(b, db)]), (attacker, [(a, da), (b, db)])):
            for meta, data in items:
                assert await put(tier, meta, data)
        assert await one.clear() == 64
        assert await two.contains([a.key]) == 0, "a forged claim kept the chunk"
        assert await two.contains([b.key]) == 1  # two's honest claim holds it
        assert await two.clear() == 32
        assert await one.contains([b.key]) == 0
        assert one.entries_rejected + two.entries_rejected >= 2
    finally:
        await one.close()
        await two.close()
        await attacker.close()


async def test_without_a_secret_the_tier_works_and_says_so(redis_server: RedisServer,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """No secret: one WARNING at start naming the key that fixes it; the MAC (keyed by nothing secret) still
    catches values moved between keys."""
    caplog.set_level(logging.INFO, TIER_LOG)
    tier, other = make_tier(redis_server, secret=None), make_tier(redis_server, secret=None, key_prefix="other")
    try:
        tier.start()
        warnings = [r.getMessage() for r in caplog.records if r.name == TIER_LOG and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "remote_auth_secret_file" in warnings[0]
        meta, data = chunk(30)
        theirs, their_data = evil_twin(meta)
        assert await put(tier, meta, data) and await get(tier, meta) == data
        assert await put(other, theirs, their_data)
        with redis_server.client() as client:
            client.set(tier.chunk_key(meta.key), client.get(other.chunk_key(meta.key)))
        assert await get(tier, meta) is None
        assert (await tier.stats())[0].details["authenticated"] is False
    finally:
        await tier.close()
        await other.close()


# ---- where the secret comes from -----------------------------------------------------------------------------
def auth_of(config: EngineConfig, mesh_url: str | None) -> RedisAuth:
    """The Redis tier's key as the engine resolves it: from the credentials file it connects with."""
    return resolve_auth(config, engine_credentials_file(config, mesh_url))


def test_the_secret_comes_from_the_file_else_the_sharing_domain(tmp_path: Path) -> None:
    mesh = MeshCredentials(tmp_path / "mesh")
    mesh.ensure("engine.a", "engine.b")
    mesh.ensure("engine.c", domain="tenant-c")
    secret_file = tmp_path / "redis.secret"
    secret_file.write_text("0123456789abcdef0123456789abcdef\n")
    secret_file.chmod(0o600)

    def tag(config: EngineConfig) -> bytes:  # the id of the keys it resolves to (a digest of them)
        return auth_of(config, None).key_id

    a, b, c = (EngineConfig(nats_credentials=str(mesh.file(f"engine.{n}"))) for n in "abc")
    assert auth_of(a, None).keyed and tag(a) == tag(b) != tag(c)  # one secret per domain
    assert tag(a) != tag(EngineConfig())  # no credentials: no secret
    assert not auth_of(EngineConfig(), None).keyed
    from_file = EngineConfig(nats_credentials=str(mesh.file("engine.a")), remote_auth_secret_file=str(secret_file))
    assert auth_of(from_file, None).keyed and tag(from_file) not in (tag(a), tag(c))  # the file wins
    assert tag(from_file) == tag(EngineConfig(remote_auth_secret_file=str(secret_file)))
    env = {"LMCACHE_REMOTE_AUTH_SECRET_FILE": str(secret_file)}
    assert load_engine_config(environ=env).remote_auth_secret_file == str(secret_file)


def test_an_engine_on_a_kvmesh_started_nats_uses_its_provisioned_domain_secret(nats_mesh: LocalMesh) -> None:
    """No nats_credentials given: the file a KVMesh-started NATS on this host provisions for the engine is where
    its domain secret comes from (what cache_engine passes: the mesh URL)."""
    url = nats_mesh.start_nats()
    mesh_dir = MeshCredentials(local_mesh_dir(int(url.rsplit(":", 1)[1])))
    mesh_dir.ensure(Principal.engine("tenant-b").path, domain="b")
    for instance in ("tenant-a", "tenant-b"):
        assert provision(url, Principal.engine(instance).path) is not None  # as the engine does at start
    config_a, config_b = (EngineConfig(lmcache_instance_id=i) for i in ("tenant-a", "tenant-b"))
    a, b = auth_of(config_a, url), auth_of(config_b, url)
    assert a.keyed and b.keyed and "sharing domain default" in a.source and "sharing domain b" in b.source
    explicit = auth_of(EngineConfig(nats_credentials=str(mesh_dir.file("engine.tenant-a"))), None)
    assert a.key_id == explicit.key_id != b.key_id
    assert not auth_of(config_a, None).keyed  # no mesh URL, no credentials: no secret
    token_only = EngineConfig(lmcache_instance_id="tenant-a", nats_token="a token")
    assert not auth_of(token_only, url).keyed  # credentials that are no KVMesh file: no secret


@pytest.mark.parametrize(("content", "mode", "problem"), [
    (None, 0o600, "cannot read"), ("short", 0o600, "at least 16"),
    ("0123456789abcdef0123456789abcdef", 0o644, "chmod 600")])
def test_a_bad_secret_file_is_a_config_error_naming_the_key(tmp_path: Path, content: str | None, mode: int,
                                                           problem: str) -> None:
    path = tmp_path / "redis.secret"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    with pytest.raises(ConfigError, match=rf"remote_auth_secret_file.*{problem}"):
        EngineConfig(remote_auth_secret_file=str(path))


def test_engines_share_chunks_only_with_the_same_secret(redis_server: RedisServer, tmp_path: Path) -> None:
    """Through cache engines on one Redis and one prefix: an engine with the writer's secret loads the chunks
    bit-exact; one with another `remote_auth_secret_file` misses them (vLLM recomputes) and leaves them to the
    writer's group (no deleting each other's values on reads)."""
    files = []
    for name in ("ours", "theirs"):
        files.append(tmp_path / f"{name}.secret")
        files[-1].write_text(f"{name} secret: thirty-two bytes!\n")
        files[-1].chmod(0o600)
    with EmbeddedNats() as nats:
        kvs = [PagedKV(num_blocks=64, seed=i) for i in range(3)]
        secrets_of = [files[0], files[0], files[1]]
        engines = [build_engine(engine_config(nats_url=nats.url, remote_url=redis_server.url, local_cpu=False,
                                             lmcache_instance_id=f"e{i}", remote_auth_secret_file=str(secret)),
                                KeyParams(model="test-model", kv_format=""), kv.layout)
                   for i, (kv, secret) in enumerate(zip(kvs, secrets_of))]
        try:
            for engine in engines:
                assert engine.wait_connected(WAIT_S)
                wait_until(lambda: engine.storage.lower(REMOTE) is not None, what="the Redis tier")
                assert engine.storage.lower(REMOTE).auth.keyed  # type: ignore[union-attr]
            writer, same, other = engines
            tokens = random_tokens(96, seed=7)
            src = kvs[0].slots(96)
            token_api.store(writer, tokens, **kvs[0].kv(src))
            assert writer.wait_write_behind(WAIT_S)
            assert token_api.lookup(same, tokens) == 96
            dst = kvs[1].slots(96)
            assert bool(token_api.retrieve(same, tokens, **kvs[1].kv(dst)).all())
            assert torch.equal(kvs[1].token_kv(dst), kvs[0].token_kv(src))
            dst = kvs[2].slots(96)
            assert not bool(token_api.retrieve(other, tokens, **kvs[2].kv(dst)).any())  # another secret: a miss
            assert other.storage.lower(REMOTE).values_foreign >= 1  # type: ignore[union-attr]
            dst = kvs[1].slots(96)
            assert bool(token_api.retrieve(same, tokens, **kvs[1].kv(dst)).all())  # still there for the writer's group
            assert torch.equal(kvs[1].token_kv(dst), kvs[0].token_kv(src))
        finally:
            for engine in engines:
                engine.close()
