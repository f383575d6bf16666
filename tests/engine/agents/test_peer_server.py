"""An engine's CPU tier served to peers over the stream data path (services/engine/agents/peer_server.py): a real
CPU tier and memory pool, the generic stream server on loopback, the engine's own stream client."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvmesh.services.engine.agents.peer_server import CpuTierSource
from kvmesh.services.engine.tiers.cpu import LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import MemoryPool
from kvmesh.services.engine.tiers.remote_stream import StreamConnection
from kvmesh.shared import protocol
from kvmesh.shared.wire.stream_server import StreamServer
from kvmesh.shared.wire.stream_wire import StreamError

SLOT = 8192


def resident(cpu: LocalCPUBackend, key: bytes, data: bytes) -> None:
    """`data` as the chunk `key` in the CPU tier, its meta without a checksum (as a fresh store leaves it)."""
    slot = cpu.allocate()
    assert slot is not None
    slot.chunk_buffer(len(data)).view[:] = data
    meta = protocol.ChunkMeta(key=key, num_tokens=16, shape=[len(data)], dtype="uint8", fmt="test", nbytes=len(data))
    assert cpu.put(meta, slot)


async def served(cpu: LocalCPUBackend) -> tuple[StreamServer, StreamConnection]:
    server = StreamServer(CpuTierSource(cpu), "127.0.0.1")
    await server.start()
    offer = protocol.StreamOffer(host="127.0.0.1", port=server.port, ticket=server.issue_ticket("engine.b.b"))
    return server, await StreamConnection.open(offer, "peer-b")


def test_a_peer_gets_a_cpu_tier_chunk_checked_and_a_miss_for_anything_else() -> None:
    async def run() -> None:
        cpu = LocalCPUBackend(MemoryPool(4 * SLOT, SLOT, use_shm=False))
        data = os.urandom(SLOT - 100)
        resident(cpu, b"a" * 16, data)
        server, connection = await served(cpu)
        try:
            buffer = memoryview(bytearray(SLOT))
            reply = await connection.get_into(b"a" * 16, buffer)
            assert reply.found and reply.meta is not None and reply.meta.checksum
            assert bytes(buffer[:len(data)]) == data
            assert not (await connection.get_into(b"z" * 16, buffer)).found
            slot_refs = cpu.acquire(b"a" * 16)
            assert slot_refs is not None and slot_refs.slot.refs == 2  # the tier's and ours: the get released its
            assert slot_refs.meta.checksum == reply.meta.checksum  # computed once, kept for the next peer
            slot_refs.release()
            ack = await connection.put(reply.meta, buffer[:len(data)])  # gets only: refused, connection closed
            assert not ack.ok and "gets only" in ack.error
            with pytest.raises((StreamError, OSError)):
                await connection.get_into(b"a" * 16, buffer)
        finally:
            connection.close()
            await server.stop()


    asyncio.run(run())


def test_a_chunk_evicted_while_it_is_sent_keeps_its_bytes_until_the_send_is_done() -> None:
    """The get holds the slot: the tier may drop the chunk meanwhile, but its slot is not reused before the send
    released it, so the peer never receives another chunk's bytes."""
    cpu = LocalCPUBackend(MemoryPool(2 * SLOT, SLOT, use_shm=False))
    source = CpuTierSource(cpu)
    first = os.urandom(SLOT - 8)
    resident(cpu, b"a" * 16, first)
    held = source.acquire(b"a" * 16, "engine.b.b")
    assert held is not None
    assert cpu.remove(b"a" * 16)  # evicted mid-transfer
    for key in (b"b" * 16, b"c" * 16):  # new chunks (each evicting the one before) never get the held slot
        resident(cpu, key, os.urandom(SLOT - 8))
        ref = cpu.acquire(key)
        assert ref is not None and ref.slot.index != held.ref.slot.index
        ref.release()
    assert bytes(held.data()) == first
    free = cpu.pool.num_free
    source.release(held)
    assert cpu.pool.num_free == free + 1  # now the slot is free again
    assert source.acquire(b"a" * 16, "engine.b.b") is None  # and the evicted chunk is a miss


def test_a_connection_without_a_valid_ticket_is_refused() -> None:
    async def run() -> None:
        cpu = LocalCPUBackend(MemoryPool(2 * SLOT, SLOT, use_shm=False))
        server = StreamServer(CpuTierSource(cpu), "127.0.0.1")
        await server.start()
        try:
            ticket = server.issue_ticket("engine.b.b")
            offer = protocol.StreamOffer(host="127.0.0.1", port=server.port, ticket=ticket)
            (await StreamConnection.open(offer, "peer-b")).close()
            with pytest.raises(StreamError, match="refused"):  # single use
                await StreamConnection.open(offer, "peer-b")
            with pytest.raises(StreamError, match="refused"):
                await StreamConnection.open(protocol.StreamOffer("127.0.0.1", server.port, b"x" * 16), "peer-c")
            assert server.counters["stream_bad_tickets"] == 2
        finally:
            await server.stop()

    asyncio.run(run())
