"""The remote store as its own process (`python -m kvmesh.services.remote_store`) on a real nats-server:
two engine-side client processes sharing a chunk, three replicas with one killed, persistence across a
restart, slow receivers, garbage on every subject and on the stream port, and NATS credentials.

Every store process gets a parent-death signal and is stopped by the fixture; every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import msgpack
import numpy as np
import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers import remote_stream
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent
from kvmesh.shared.wire import chunk_file, stream_wire
from kvmesh.shared.wire.partition import partition_of

from support.remote_store import ENGINE, MiB, nats_url  # noqa: F401 (nats_url: a fixture)
from support.waiting import WAIT_S, wait_until_async


class StoreProcesses:
    """Spawns store processes; `stop_all` ends those still running (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, nats_url: str, store_id: str, *args: str, size_gb: float = 0.25,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{store_id}-{len(self.processes)}.log", "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.services.remote_store", "--nats-url", nats_url, "--store-id", store_id,
             "--max-size-gb", str(size_gb), *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, preexec_fn=_die_with_parent)
        log.close()
        process.log_path = log.name  # type: ignore[attr-defined]
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def output_of(process: subprocess.Popen[bytes]) -> str:
    return Path(process.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


@pytest.fixture
def stores(tmp_path: Path):
    processes = StoreProcesses(tmp_path)
    yield processes
    processes.stop_all()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[object]:
    connection = await bus.connect(nats_url, "test-remote-process")
    yield connection
    await connection.close()


async def wait_healthy(nc, store_id: str, process: subprocess.Popen[bytes]) -> None:
    async def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"{store_id} exited with {process.returncode}:\n{output_of(process)[-3000:]}")
        try:
            await bus.request(nc, protocol.Subjects.health(protocol.store_path(store_id)), protocol.HealthRequest(),
                              protocol.HealthReply, 1)
        except MeshUnavailable:
            return False
        return True

    try:
        await wait_until_async(healthy, what=f"{store_id} healthy", interval=0.05)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}:\n{output_of(process)[-3000:]}") from None


def make_chunk(nbytes: int, seed: int, key: bytes | None = None, num_tokens: int = 256
               ) -> tuple[protocol.ChunkMeta, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    meta = protocol.ChunkMeta(key=key or os.urandom(16), num_tokens=num_tokens, shape=[nbytes], dtype="uint8",
                              fmt="test", nbytes=nbytes, checksum=chunk_file.checksum(memoryview(data)))
    return meta, data


# An engine-side process: computes the chunk keys of a token sequence itself (host-independent keys), then puts
# or gets them through its own RemoteStoreClient. The bytes of a chunk derive from its key.
ENGINE_SCRIPT = r"""
import asyncio, sys
import numpy as np
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkHasher, KeyParams

async def main(url, store_ids, mode):
    nc = await bus.connect(url, "engine-" + mode)
    client = RemoteStoreClient(nc, store_ids.split(","), protocol.Principal.engine(mode).producer("w0"),
                               request_timeout=30.0)
    spans = ChunkHasher(KeyParams(model="shared-model", kv_format="uint8/test"), chunk_size=256).spans(range(600))
    chunks = []
    for span in spans:
        nbytes = span.num_tokens * 4096
        data = np.random.default_rng(int.from_bytes(span.key[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)
        meta = protocol.ChunkMeta(key=span.key, num_tokens=span.num_tokens, shape=[nbytes], dtype="uint8",
                                  fmt="test", nbytes=nbytes, checksum=chunk_file.checksum(memoryview(data)))
        chunks.append((meta, data))
    if mode == "put":
        results = [await client.put(meta, ChunkBuffer(memoryview(data))) for meta, data in chunks]
        print("put", sum(results), flush=True)
    else:
        held = await client.contains([meta.key for meta, _ in chunks])
        same = 0
        for meta, data in chunks:
            out = np.zeros(meta.nbytes, dtype=np.uint8)
            got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
            same += got is not None and got.num_tokens == meta.num_tokens and np.array_equal(out, data)
        print("get", held, same, flush=True)
    await client.close()
    await nc.close()

asyncio.run(main(*sys.argv[1:4]))
"""


def run_engine(nats_url: str, store_ids: str, mode: str) -> str:
    result = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, nats_url, store_ids, mode], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


async def test_two_engine_processes_share_chunks(nats_url: str, nc, stores: StoreProcesses) -> None:
    process = stores.spawn(nats_url, "share-0")
    await wait_healthy(nc, "share-0", process)
    assert await asyncio.to_thread(run_engine, nats_url, "share-0", "put") == "put 3"
    # another engine process (as on another host) finds and loads all three, bit-exact
    assert await asyncio.to_thread(run_engine, nats_url, "share-0", "get") == "get 3 3"


async def test_three_replicas_each_key_on_one_and_a_dead_one_only_misses(nats_url: str, nc,
                                                                         stores: StoreProcesses) -> None:
    ids = [f"tri-{i}" for i in range(3)]
    processes = [stores.spawn(nats_url, store_id, "--partition", str(i), "--partitions", "3")
                 for i, store_id in enumerate(ids)]
    for store_id, process in zip(ids, processes):
        await wait_healthy(nc, store_id, process)
    # A replica that fails is not asked again for retry_interval: here, for the rest of the test.
    client = RemoteStoreClient(nc, ids, ENGINE, request_timeout=WAIT_S, retry_interval=3600.0)
    try:
        chunks = [make_chunk(64 * 1024, seed) for seed in range(30)]
        for meta, data in chunks:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        for meta, _ in chunks:  # ask every replica directly: exactly the owner holds the key
            holders = [(await bus.request(nc, protocol.Subjects.store(store_id, "contains", ENGINE),
                                          protocol.ChunkKeys(keys=[meta.key]), protocol.ContainsReply, WAIT_S)).prefix
                       for store_id in ids]
            assert holders == [int(i == partition_of(meta.key, 3)) for i in range(3)]
        assert sorted(s.num_chunks for s in await client.stats()) == sorted(
            sum(partition_of(m.key, 3) == i for m, _ in chunks) for i in range(3))
        processes[1].kill()
        processes[1].wait(WAIT_S)
        failures: list[object] = []  # the dead replica's failures, as its client link records them
        dead_link = client._replicas[1].link

        def record_failure(reason: object, failed=dead_link.failed) -> None:
            failures.append(reason)
            failed(reason)

        dead_link.failed = record_failure  # type: ignore[method-assign]
        out = np.zeros(64 * 1024, dtype=np.uint8)
        for meta, data in chunks:
            got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
            if partition_of(meta.key, 3) == 1:
                assert got is None
            else:
                assert got is not None and np.array_equal(out, data)
        alive = [m.key for m, _ in chunks if partition_of(m.key, 3) != 1]
        assert await client.contains(alive) == len(alive)
        assert len(await client.stats()) == 2
        # misses are quick: the dead replica cost one failed call (at most one timeout), not one per key
        assert len(failures) == 1 and not dead_link.reachable and dead_link.resting
    finally:
        await client.close()


async def test_persistence_across_restart(nats_url: str, nc, stores: StoreProcesses, tmp_path: Path) -> None:
    persist = tmp_path / "persist"
    args = ("--persist-dir", str(persist))
    process = stores.spawn(nats_url, "keep-0", *args)
    await wait_healthy(nc, "keep-0", process)
    client = RemoteStoreClient(nc, ["keep-0"], ENGINE, request_timeout=WAIT_S, retry_interval=0.1)
    try:
        chunks = [make_chunk(n, seed) for seed, n in enumerate([MiB, 3 * MiB + 5, 4096, 777, 2 * MiB])]
        for meta, data in chunks:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        assert await client.remove([chunks[3][0].key]) == 1

        async def written() -> bool:
            stats = await client.stats()
            return bool(stats) and stats[0].details["pending_writes"] == 0

        await wait_until_async(written, what="persisted files written")
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
        assert not chunk_file.chunk_path(persist, chunks[3][0].key).exists()  # the removed chunk's file is gone
        damaged = chunk_file.chunk_path(persist, chunks[2][0].key)
        raw = bytearray(damaged.read_bytes())
        raw[-1] ^= 0xFF  # flip a bit of the data: the checksum must catch it at load
        damaged.write_bytes(bytes(raw))

        process = stores.spawn(nats_url, "keep-0", *args)
        await wait_healthy(nc, "keep-0", process)
        for index, (meta, data) in enumerate(chunks):
            out = np.zeros(meta.nbytes, dtype=np.uint8)
            got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
            if index in (2, 3):  # damaged, removed
                assert got is None
            else:
                assert got is not None and got.checksum == chunk_file.checksum(memoryview(data))
                assert np.array_equal(out, data)
        (stats,) = await client.stats()
        assert stats.num_chunks == 3 and not damaged.exists()
    finally:
        await client.close()


async def test_persisted_pins_are_on_disk_once_answered(nats_url: str, nc, stores: StoreProcesses,
                                                        tmp_path: Path) -> None:
    """With --persist-dir, pin and unpin answer once the pins file holds them: a SIGKILL right after keeps them."""
    args = ("--persist-dir", str(tmp_path / "persist"))
    process = stores.spawn(nats_url, "pins-0", *args)
    await wait_healthy(nc, "pins-0", process)
    client = RemoteStoreClient(nc, ["pins-0"], ENGINE, request_timeout=WAIT_S, retry_interval=0.1)

    async def pinned_after_sigkill() -> int:
        nonlocal process
        process.send_signal(signal.SIGKILL)
        process.wait(WAIT_S)
        process = stores.spawn(nats_url, "pins-0", *args)
        await wait_healthy(nc, "pins-0", process)
        (stats,) = await client.stats()
        return stats.pinned_chunks

    try:
        keys = []
        for seed in range(3):
            meta, data = make_chunk(4096, seed)
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
            keys.append(meta.key)

        async def written() -> bool:
            stats = await client.stats()
            return bool(stats) and stats[0].details["pending_writes"] == 0

        await wait_until_async(written, what="persisted files written")
        assert await client.pin(keys, [256] * 3) == 3 * 256
        assert await pinned_after_sigkill() == 3
        assert await client.unpin(keys[:1], [256]) == 256
        assert await pinned_after_sigkill() == 2
    finally:
        await client.close()


async def _greeted_socket(nc, store_id: str, rcvbuf: int | None = None) -> socket.socket:
    """A stream connection made by hand (optionally with a small receive buffer, so a slow reader throttles
    the store instead of the kernel absorbing the whole chunk)."""
    offer = await bus.request(nc, protocol.Subjects.store(store_id, "stream", ENGINE), protocol.StreamRequest(client="t"),
                              protocol.StreamOffer, WAIT_S)
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (offer.host, offer.port)), WAIT_S)
    await stream_wire.send_request(sock, stream_wire.OP_HELLO, protocol.StreamHello(ticket=offer.ticket))
    assert (await asyncio.wait_for(stream_wire.recv_reply(sock, protocol.Ack), WAIT_S)).ok
    return sock


async def _slow_get(nc, store_id: str, key: bytes, nbytes: int, piece: int, pause: float,
                    rcvbuf: int | None = None) -> tuple[protocol.GetReply, int, bytearray]:
    """A get read `piece` bytes at a time with a `pause` after each piece (the pace of a slow reader is the
    behaviour under test); (reply, bytes received, bytes)."""
    sock = await _greeted_socket(nc, store_id, rcvbuf=rcvbuf)
    loop = asyncio.get_running_loop()
    try:
        await stream_wire.send_request(sock, stream_wire.OP_GET, protocol.GetRequest(key=key, capacity=nbytes))
        reply = await asyncio.wait_for(stream_wire.recv_reply(sock, protocol.GetReply), WAIT_S)
        out = bytearray(nbytes)
        view, got = memoryview(out), 0
        while got < nbytes:
            end = min(nbytes, got + piece)
            while got < end:
                count = await asyncio.wait_for(loop.sock_recv_into(sock, view[got:end]), WAIT_S)
                if count == 0:
                    return reply, got, out
                got += count
            await asyncio.sleep(pause)
        return reply, got, out
    finally:
        sock.close()


async def _dropped_by_the_store(sock: socket.socket) -> None:
    """Read until the store closes the connection (end of stream, or a reset if it left our bytes unread)."""
    loop = asyncio.get_running_loop()
    try:
        while await asyncio.wait_for(loop.sock_recv(sock, 65536), WAIT_S):
            pass
    except ConnectionResetError:
        pass


async def test_slow_receivers_get_the_whole_chunk_or_an_error(nats_url: str, nc, stores: StoreProcesses) -> None:
    process = stores.spawn(nats_url, "slow-0", "--transfer-timeout", "5")
    await wait_healthy(nc, "slow-0", process)
    client = RemoteStoreClient(nc, ["slow-0"], ENGINE, request_timeout=WAIT_S, retry_interval=0.0)
    try:
        meta, data = make_chunk(32 * MiB, 5)
        small, small_data = make_chunk(4 * MiB, 6)
        for chunk_meta, chunk_data in ((meta, data), (small, small_data)):
            assert await client.put(chunk_meta, ChunkBuffer(memoryview(chunk_data)))
        # slow, well within the store's 5 s transfer deadline (~0.1 s of pauses): the whole chunk, checksum intact
        reply, got, out = await _slow_get(nc, "slow-0", small.key, small.nbytes, piece=MiB // 2, pause=0.01)
        assert reply.found and got == small.nbytes and chunk_file.checksum(out) == reply.meta.checksum
        # too slow: the store gives up on this connection; the reader sees the connection end early (an error),
        # never a short chunk passed off as whole
        reply, got, out = await _slow_get(nc, "slow-0", meta.key, meta.nbytes, piece=64 * 1024, pause=0.05,
                                          rcvbuf=64 * 1024)  # at most 1.3 MB/s: 32 MiB would take 25 s
        assert reply.found and got < meta.nbytes
        # a client whose event loop is too busy to read fast: whole and verified, or None; never wrong bytes
        stop = asyncio.Event()

        async def hog() -> None:
            while not stop.is_set():
                time.sleep(0.03)  # blocks this loop, as a busy engine thread would
                await asyncio.sleep(0)

        hog_task = asyncio.create_task(hog())
        result = np.zeros(meta.nbytes, dtype=np.uint8)
        got_meta = await client.get_into(meta.key, ChunkBuffer(memoryview(result)))
        stop.set()
        await hog_task
        assert got_meta is None or np.array_equal(result, data)
        # the store kept serving through all of it
        result[:] = 0
        assert await client.get_into(meta.key, ChunkBuffer(memoryview(result))) is not None
        assert np.array_equal(result, data)
        assert process.poll() is None
    finally:
        await client.close()


async def test_garbage_on_every_subject_and_the_stream_port_leaves_it_serving(nats_url: str, nc,
                                                                           stores: StoreProcesses) -> None:
    process = stores.spawn(nats_url, "junk-0")
    await wait_healthy(nc, "junk-0", process)
    client = RemoteStoreClient(nc, ["junk-0"], ENGINE, request_timeout=WAIT_S, retry_interval=0.0)
    good, good_data = make_chunk(4096, 1)
    assert await client.put(good, ChunkBuffer(memoryview(good_data)))
    try:
        wrong_types = msgpack.packb({"v": 1, "t": "chunk_keys", "keys": "not a list", "ttl_secs": "x"})
        short_key = protocol.ChunkMeta(key=b"abc", num_tokens=1, shape=[4], dtype="uint8", fmt="t", nbytes=4)
        lying_size = protocol.ChunkMeta(key=os.urandom(16), num_tokens=1, shape=[4], dtype="uint8", fmt="t", nbytes=9)
        payloads = [b"", b"\xff\x00garbage", msgpack.packb([1, 2, 3]), msgpack.packb({"v": 99, "t": "ack"}),
                    wrong_types, protocol.encode(protocol.HealthRequest()),
                    protocol.encode(protocol.PutRequest(meta=short_key, data=b"abcd")),
                    protocol.encode(protocol.PutRequest(meta=lying_size, data=b"abcd")),
                    protocol.encode(protocol.GetRequest(key=b"x")),
                    protocol.encode(protocol.ChunkKeys(keys=[b"", b"\x00" * 300], num_tokens=[-1])),
                    protocol.encode(protocol.StreamHello(ticket=b"forged"))]
        subjects = [protocol.Subjects.store("junk-0", op, ENGINE) for op in
                    ("stream", "put", "get", "contains", "remove", "clear", "wipe", "pin", "unpin", "stats", "touch")]
        path = protocol.store_path("junk-0")
        subjects += [protocol.Subjects.health(path), protocol.Subjects.sync(path), protocol.Subjects.PING_ALL]
        for subject in subjects:
            for payload in payloads:
                await nc.publish(subject, payload)
                try:
                    await nc.request(subject, payload, timeout=0.5)
                except Exception:
                    pass  # no reply at all is fine; crashing is not
        # and on the stream port: noise, a huge announced header, a forged ticket, bad requests after a good hello
        offer = await bus.request(nc, protocol.Subjects.store("junk-0", "stream", ENGINE), protocol.StreamRequest(),
                                  protocol.StreamOffer, WAIT_S)
        loop = asyncio.get_running_loop()
        for noise in (os.urandom(5000), b"H" + struct.pack("<I", 2**31), b"H\x05\x00\x00\x00hello",
                      b"P" + struct.pack("<I", 3) + b"abc"):
            sock = socket.socket()
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, (offer.host, offer.port)), WAIT_S)
            await loop.sock_sendall(sock, noise)
            sock.close()
        bad_requests = [
            (stream_wire.OP_PUT, protocol.PutRequest(meta=protocol.ChunkMeta(
                key=os.urandom(16), num_tokens=1, shape=[1], dtype="u8", fmt="t", nbytes=-5))),
            (b"Z", protocol.ClearRequest()),
            (stream_wire.OP_GET, protocol.ChunkKeys(keys=[])),
        ]
        for op, message in bad_requests:
            sock = await _greeted_socket(nc, "junk-0")
            await stream_wire.send_request(sock, op, message)
            await _dropped_by_the_store(sock)  # it read the bad request and gave up on this connection
            sock.close()
        # bytes that do not match their checksum are refused, and the stream stays usable
        sock = await _greeted_socket(nc, "junk-0")
        connection = remote_stream.StreamConnection(sock, "junk")
        meta, data = make_chunk(100_000, 2)
        bad = protocol.ChunkMeta(**{**meta.__dict__, "checksum": chunk_file.checksum(memoryview(data)) ^ 1})
        ack = await asyncio.wait_for(connection.put(bad, memoryview(data)), WAIT_S)
        assert not ack.ok and "checksum" in ack.error
        assert (await asyncio.wait_for(connection.put(meta, memoryview(data)), WAIT_S)).ok
        connection.close()
        # still serving
        assert process.poll() is None
        out = np.zeros(4096, dtype=np.uint8)
        assert await client.get_into(good.key, ChunkBuffer(memoryview(out))) is not None
        assert np.array_equal(out, good_data)
        (stats,) = await client.stats()
        assert stats.details["checksum_failures"] == 1 and await client.contains([meta.key]) == 1
    finally:
        await client.close()


async def test_credentials_required_work_when_given_and_fail_clearly_when_not(stores: StoreProcesses) -> None:
    token = "tok-" + os.urandom(8).hex()
    with EmbeddedNats(token=token) as server:
        with pytest.raises(MeshUnavailable, match="rejected .*Authorization Violation"):
            await bus.connect(server.url, "no-token", bus.NatsAuth(auth_retry_secs=0), first_connect_wait=WAIT_S)
        refused = stores.spawn(server.url, "auth-x", "--nats-auth-retry-secs", "1")  # a store without the token stops with a clear message
        assert await asyncio.to_thread(refused.wait, WAIT_S) == 2
        assert "rejected remote_store:auth-x (no credentials)" in output_of(refused)

        process = stores.spawn(server.url, "auth-0", "--nats-token", token)
        nc = await bus.connect(server.url, "with-token", bus.NatsAuth(token=token), first_connect_wait=WAIT_S)
        try:
            await wait_healthy(nc, "auth-0", process)
            client = RemoteStoreClient(nc, ["auth-0"], ENGINE, request_timeout=WAIT_S)
            meta, data = make_chunk(MiB, 3)
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
            out = np.zeros(MiB, dtype=np.uint8)
            assert await client.get_into(meta.key, ChunkBuffer(memoryview(out))) is not None
            assert np.array_equal(out, data)
            await client.close()
        finally:
            await nc.close()

    users = 'authorization { users: [ { user: "kv", password: "pw-1" } ] }'
    with EmbeddedNats(extra_config=users) as server:
        # user/password from the environment (secrets need not be on the command line)
        process = stores.spawn(server.url, "auth-1", env={"KVMESH_NATS_USER": "kv", "KVMESH_NATS_PASSWORD": "pw-1"})
        nc = await bus.connect(server.url, "with-user", bus.NatsAuth(user="kv", password="pw-1"), first_connect_wait=WAIT_S)
        try:
            await wait_healthy(nc, "auth-1", process)
            (stats,) = await RemoteStoreClient(nc, ["auth-1"], ENGINE, request_timeout=WAIT_S).stats()
            assert stats.store_id == "auth-1"
        finally:
            await nc.close()
        with pytest.raises(MeshUnavailable, match="user/password"):
            await bus.connect(server.url, "bad-password", bus.NatsAuth(user="kv", password="nope"), first_connect_wait=WAIT_S)
