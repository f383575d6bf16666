"""End to end: two vLLM instances (the CPU build, the demo model) whose remote tier is one real redis-server.

Instance "a" serves a prompt cold; its chunks reach Redis (the test waits on the keys there); instance "b",
which never saw the prompt, then serves it as a hit loaded from Redis (`assert_loaded`: the worker retrieved what
the scheduler promised, no load error), and its output equals that of a vLLM without the connector ("ref").
vLLM's own prefix cache is off, and each engine embeds its own NATS (no `nats_url`), so Redis is the only path
between the two instances. The CPU tier is kept small (`max_local_cpu_size: 0.25`), as in the quickstarts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from support.e2e import VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm
from support.redis_server import RedisServer
from support.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256
PREFIX = "e2e"


def redis_yaml(path: Path, remote_url: str) -> Path:
    config = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.25,
        "remote_url": remote_url,
        "redis_key_prefix": PREFIX,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def output_text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


@pytest.fixture(scope="module")
def redis_vllms(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("e2e-redis")
    redis_server = RedisServer().start()
    servers = []
    for name in ("a", "b"):
        home = work / name  # each instance its own working directory (its embedded mesh's files)
        home.mkdir()
        env = clean_env(LMCACHE_CONFIG_FILE=str(redis_yaml(home / "redis.yaml", redis_server.url)))
        servers.append(VLLMServer(f"vllm-redis-{name}", demo_model, free_port(), work / f"vllm-{name}.log",
                                  kv_config=kv_transfer_config(), env=env, cwd=home))
    ref = VLLMServer("vllm-redis-ref", demo_model, free_port(), work / "vllm-ref.log")
    try:
        start_vllm(*servers, ref)
        yield {"a": servers[0], "b": servers[1], "ref": ref, "redis": redis_server}
    finally:
        for server in (ref, *servers):
            server.stop()
        redis_server.stop()


def test_prompt_served_by_one_instance_is_a_redis_hit_on_the_other(redis_vllms: dict[str, Any],
                                                                    long_text: str) -> None:
    a: VLLMServer = redis_vllms["a"]
    b: VLLMServer = redis_vllms["b"]
    ref: VLLMServer = redis_vllms["ref"]
    redis_server: RedisServer = redis_vllms["redis"]
    prompt = f"[redis]\n{long_text[30_000:39_000]}"

    expected = ref.complete(prompt, max_tokens=16)
    num_tokens = expected["usage"]["prompt_tokens"]
    assert num_tokens > 4 * CHUNK, num_tokens

    cold = a.complete(prompt, max_tokens=16)
    assert a.hit_for(cold).hit == 0
    assert output_text(cold) == output_text(expected)

    def chunks_in_redis() -> int | None:  # the store reaches Redis after the forward, asynchronously
        with redis_server.client() as client:
            count = sum(1 for _ in client.scan_iter(match=f"{PREFIX}:chunk:*", count=1000))
        return count if count >= num_tokens // CHUNK else None

    wait_until(chunks_in_redis, WAIT_S, interval=0.2, what=f"{num_tokens // CHUNK} chunks of instance a in Redis")

    warm = b.complete(prompt, max_tokens=16)  # b's first request
    hit = b.assert_loaded(warm)
    assert hit.total == num_tokens and hit.hit >= num_tokens - CHUNK, hit
    assert output_text(warm) == output_text(expected)
