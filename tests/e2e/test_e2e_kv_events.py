"""End to end: one real vLLM (CPU build) with KVMeshConnector, on a `kvmesh up` mesh whose controller publishes
the fleet-wide KV event stream (`--kv-events-port`), and with vLLM's own KV event publisher (`--kv-events-config`).

* vLLM's stream: the chunks KVMesh's CPU tier admits are BlockStored events (medium "CPU"), read by a pyzmq SUB
  socket connected before vLLM starts, so that it is subscribed before the first event (ZMQ drops what a PUB
  socket sends before a subscriber's subscription arrives).
* The controller's stream: the engine has `describe_admissions` on, so the same chunks are BlockStored events
  with the same hashes, parents and token ids on the engine worker's topic, read as a router would with vLLM's
  own event classes (tests/support/kv_event_stream.py).

Each test serves a prompt of its own, so they do not depend on each other's order.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgspec
import pytest
import yaml
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvmesh.shared.protocol import LOCAL_CPU

from support.e2e import MeshUp, VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm
from support.kv_event_stream import subscribed
from support.waiting import WAIT_S, wait_until, wait_until_async

pytestmark = pytest.mark.vllm

CHUNK = 256
INSTANCE = "kv-events-e2e"
VLLM_TOPIC = "kv-events"


class VLLMStream:
    """vLLM's own KV event stream: the CPU tier's BlockStored events received so far."""

    def __init__(self, port: int) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, VLLM_TOPIC)
        self._sub.connect(f"tcp://127.0.0.1:{port}")  # before vLLM binds (ZMQ retries)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.stored: list[BlockStored] = []

    def receive(self) -> list[BlockStored]:
        while self._sub.poll(0):
            topic, _seq, payload = self._sub.recv_multipart()
            assert topic == VLLM_TOPIC.encode()
            self.stored.extend(e for e in self._decoder.decode(payload).events
                               if isinstance(e, BlockStored) and e.medium == "CPU")
        return self.stored

    def close(self) -> None:
        self._sub.close(linger=0)
        self._context.term()


@dataclass
class Served:
    server: VLLMServer
    vllm_stream: VLLMStream
    stream: str  # the controller's KV event stream
    replay: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("kv-events")
    events_port, replay_port, vllm_events_port = free_port(), free_port(), free_port()
    mesh = MeshUp(work / "mesh", extra_args=["--no-disk", "--no-remote", "--kv-events-port", str(events_port),
                                             "--kv-events-replay-port", str(replay_port),
                                             "--kv-events-chunks", "1000"])
    config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25, "enable_controller": True,
              "lmcache_instance_id": INSTANCE, "controller_url": f"localhost:{mesh.nats_port}",
              "describe_admissions": True}
    (work / "kvmesh.yaml").write_text(yaml.safe_dump(config))
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{vllm_events_port}",
                     "topic": VLLM_TOPIC}
    vllm_stream = VLLMStream(vllm_events_port)
    server = VLLMServer("vllm-kv-events", demo_model, free_port(), work / "vllm.log",
                        kv_config=kv_transfer_config(),
                        env=clean_env(LMCACHE_CONFIG_FILE=str(work / "kvmesh.yaml")),
                        extra_args=["--kv-events-config", json.dumps(events_config)])
    try:
        mesh.start()
        mesh.wait_ready()
        start_vllm(server)
        yield Served(server, vllm_stream, f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}")
    finally:
        server.stop()
        mesh.stop()
        vllm_stream.close()


def prompt_tokens(server: VLLMServer, text: str) -> list[int]:
    tokens = server.tokenize(text)[: 3 * CHUNK + 40]  # three full chunks and a partial one
    assert len(tokens) == 3 * CHUNK + 40
    return tokens


def chain(events: Iterable[BlockStored], tokens: list[int]) -> list[BlockStored]:
    """The events that describe `tokens` chunk by chunk from the first, each naming the one before as parent."""
    by_parent_and_tokens = {(e.parent_block_hash, tuple(e.token_ids)): e for e in events}
    found: list[BlockStored] = []
    parent = None
    for start in range(0, len(tokens), CHUNK):
        event = by_parent_and_tokens.get((parent, tuple(tokens[start:start + CHUNK])))
        if event is None:
            break
        found.append(event)
        parent = event.block_hashes[0]
    return found


def described(events: list[BlockStored]) -> list[tuple[Any, ...]]:
    """What both streams say of a block (not `medium`: "CPU" on vLLM's, the location name on the controller's)."""
    return [(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_name, e.extra_keys)
            for e in events]


def test_cpu_tier_admissions_reach_vllms_kv_event_stream(served: Served, long_text: str) -> None:
    tokens = prompt_tokens(served.server, long_text[:8000])
    served.server.complete(tokens, max_tokens=4)

    # one chunk per event, each naming the one before it as parent, the first none
    def three_chunks() -> list[BlockStored] | None:
        found = chain(served.vllm_stream.receive(), tokens)
        return found if len(found) >= 3 else None

    published = wait_until(three_chunks, WAIT_S, interval=0.1, what="BlockStored events for the prompt's chunks")
    assert published[0].parent_block_hash is None
    assert all(e.block_size == CHUNK and len(e.block_hashes) == 1 for e in published)


def test_the_controllers_stream_describes_the_chunks_vllm_served(served: Served, long_text: str) -> None:
    """With `describe_admissions`, the controller's BlockStored events of the engine worker's chunks carry the
    prompt's token ids and parents: the same blocks, under the same hashes, as vLLM's own stream publishes."""
    tokens = prompt_tokens(served.server, f"[the controller's stream]\n{long_text[8000:16000]}")

    async def run() -> None:
        async with subscribed(served.stream, served.replay, replay_first=True) as subscriber:
            await asyncio.to_thread(served.server.complete, tokens, max_tokens=4)

            def same_chain() -> bool:
                ours = chain(served.vllm_stream.receive(), tokens)
                controllers = chain(subscriber.blocks.values(), tokens)
                return len(ours) >= 3 and described(controllers) == described(ours)

            await wait_until_async(same_chain, what="the controller's described chain equal to vLLM's")
            # all on one holder's topic: the engine worker `<instance>@<process tag>`, its CPU tier
            hashes = {e.block_hashes[0] for e in chain(served.vllm_stream.stored, tokens)}
            (worker,) = {holder for holder, block_hash in subscriber.blocks if block_hash in hashes}
            instance, tag = worker.split("@")
            assert instance == INSTANCE and tag, worker
            assert subscriber.media[worker] == {LOCAL_CPU}
            assert subscriber.models[worker] == served.server.model
            # the topic has three "@"-separated parts, as llm-d reads kv@<pod>@<model>: the worker id's "@" encoded
            assert f"kv@{INSTANCE}%40{tag}@{served.server.model}".encode() in subscriber.topics

    asyncio.run(run())
