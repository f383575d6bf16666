"""End to end: a real vLLM (CPU build) with KVMeshConnector and vLLM's KV event publisher (`--kv-events-config`)
publishes the chunks KVMesh's CPU tier admits as BlockStored events (medium "CPU") on its ZMQ stream, where a
router reads them: here a pyzmq SUB socket, connected before vLLM starts so that it is subscribed before the first
event (ZMQ drops what a PUB socket sends before a subscriber's subscription arrives).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support.e2e import VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm
from support.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256
YAML = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n"
TOPIC = "kv-events"


def test_cpu_tier_admissions_reach_vllms_kv_event_stream(tmp_path: Path, demo_model: Path, long_text: str) -> None:
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    kv_events = pytest.importorskip("vllm.distributed.kv_events")

    port = free_port()
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    # connected before vLLM binds (ZMQ retries): subscribed long before the first event is published
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    (tmp_path / "kvmesh.yaml").write_text(YAML)
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                     "topic": TOPIC}
    env = clean_env(LMCACHE_CONFIG_FILE=str(tmp_path / "kvmesh.yaml"))
    server = VLLMServer("vllm-kv-events", demo_model, free_port(), tmp_path / "vllm.log",
                        kv_config=kv_transfer_config(), env=env,
                        extra_args=["--kv-events-config", json.dumps(events_config)])
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    stored: list[Any] = []

    def receive() -> None:
        while subscriber.poll(0):
            topic, _seq, payload = subscriber.recv_multipart()
            assert topic == TOPIC.encode()
            stored.extend(e for e in decoder.decode(payload).events
                          if isinstance(e, kv_events.BlockStored) and e.medium == "CPU")

    try:
        start_vllm(server)
        tokens = server.tokenize(long_text[:8000])[: 3 * CHUNK + 40]  # three full chunks and a partial one
        assert len(tokens) == 3 * CHUNK + 40
        server.complete(tokens, max_tokens=4)

        def whole_prompt_published() -> bool:
            receive()
            return sum(len(e.token_ids) for e in stored) >= 3 * CHUNK

        wait_until(whole_prompt_published, WAIT_S, interval=0.1, what="BlockStored events for the prompt's chunks")
        # one chunk per event, in order, each naming the one before it as parent
        assert [e.token_ids for e in stored[:3]] == [tokens[i * CHUNK:(i + 1) * CHUNK] for i in range(3)]
        assert stored[0].parent_block_hash is None
        assert [e.parent_block_hash for e in stored[1:3]] == [e.block_hashes[0] for e in stored[:2]]
        assert all(e.block_size == CHUNK and len(e.block_hashes) == 1 for e in stored)
    finally:
        server.stop()
        subscriber.close(linger=0)
        context.term()
