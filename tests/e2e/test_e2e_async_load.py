"""End to end: asynchronous loads (`enable_async_loading`) on a real vLLM (CPU build) with the demo model.

The engine embeds NATS and a disk store (`local_disk`), and its CPU tier is tiny (16 chunks of 0.5 MiB): once a second
prompt has been stored, the first prompt's leading chunks are only on disk, so its next request's hit is not
all in the CPU tier and the scheduler answers load_kv_async. What is checked: the log shows the async path
("loads asynchronously", the worker's "Loading ... asynchronously" and "Retrieved N tokens" equal to what the
scheduler promised, no load error), and the output equals a vLLM without the connector. A request that only
decodes runs meanwhile: the timestamps of its tokens around the load are logged (not asserted: the machine's
timing is not the test's business), and it must produce every token it was asked for. Then the chunk files go
from the disk store: a load the scheduler promised fails, the worker reports load errors, and vLLM's recompute
gives the same output as a vLLM without the connector; the recomputed KV is stored, so the same prompt once more
is a proven load of the whole prompt, with the same output.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from support.e2e import VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm
from support.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256
ASYNC_YAML = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 0.008
local_disk: "file://local/disk/"
max_local_disk_size: 1.0
enable_async_loading: true
"""
ASYNC_LINE = "Reqid: {req} loads asynchronously"
KVMESH_TIME = re.compile(r"KVMesh \w+ (?P<when>\d\d-\d\d \d\d:\d\d:\d\d\.\d\d\d) .*?(?P<what>Loading \d+ tokens for "
                         r"request (?P<req>\S+) asynchronously|Retrieved \d+ tokens for request (?P<req2>\S+) in )")
DECODE_TOKENS = 300


def prompt_of(text: str, num_chars: int, salt: str) -> str:
    return f"[{salt}]\n{text[:num_chars]}"


class DecodeStream(threading.Thread):
    """A streamed completion of a short prompt: the wall time of each streamed piece as it arrives (one piece may
    carry several tokens when the client reads late), and the tokens generated in all (the stream's usage)."""

    def __init__(self, server: VLLMServer) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.times: list[float] = []
        self.generated = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        import httpx

        body = {"model": self.server.model, "prompt": "Count from one:", "max_tokens": DECODE_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body, timeout=300) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        piece = json.loads(line[6:])
                        if piece.get("usage"):
                            self.generated = piece["usage"]["completion_tokens"]
                        if piece["choices"] and piece["choices"][0]["text"] is not None:
                            self.times.append(time.time())
        except BaseException as exc:  # reported by the test
            self.error = exc


def clock(seconds: float) -> str:
    """A wall time as KVMesh's log lines print it."""
    return datetime.fromtimestamp(seconds).strftime("%m-%d %H:%M:%S.%f")[:-3]


def test_a_disk_hit_loads_between_steps_while_another_request_decodes(tmp_path: Path, demo_model: Path,
                                                                      long_text: str) -> None:
    (tmp_path / "async.yaml").write_text(ASYNC_YAML)
    server = VLLMServer("vllm-async", demo_model, free_port(), tmp_path / "vllm-async.log",
                        kv_config=kv_transfer_config(), env=clean_env(LMCACHE_CONFIG_FILE="async.yaml"), cwd=tmp_path)
    ref = VLLMServer("vllm-async-ref", demo_model, free_port(), tmp_path / "vllm-async-ref.log")
    try:
        start_vllm(server, ref)
        first = prompt_of(long_text[20_000:], 9_000, "async-a")
        second = prompt_of(long_text[40_000:], 9_000, "async-b")
        sizes = [len(server.tokenize(p)) for p in (first, second)]
        # each fits the 16-chunk CPU tier, both do not: storing the second evicts the first one's leading chunks
        assert all(6 * CHUNK < n < 14 * CHUNK for n in sizes) and sum(sizes) > 16 * CHUNK, sizes
        disk_dir = tmp_path / "local" / "disk"

        def chunk_files() -> int:
            return sum(1 for p in disk_dir.rglob("*") if p.is_file()) if disk_dir.is_dir() else 0

        cold = server.complete(first, max_tokens=16)
        assert server.hit_for(cold).hit == 0
        wait_until(lambda: chunk_files() >= sizes[0] // CHUNK, WAIT_S, interval=0.2, what="the first prompt on disk")
        server.complete(second, max_tokens=4)
        wait_until(lambda: chunk_files() >= sum(sizes) // CHUNK, WAIT_S, interval=0.2, what="the second prompt on disk")

        stream = DecodeStream(server)
        stream.start()
        wait_until(lambda: len(stream.times) >= 5 or stream.error is not None, WAIT_S, interval=0.05,
                   what="the decoding request producing tokens")
        sent = time.time()
        warm = server.complete(first, max_tokens=16)
        answered = time.time()
        stream.join(WAIT_S)
        assert stream.error is None and not stream.is_alive(), stream.error

        hit = server.assert_loaded(warm)  # the worker retrieved what was promised, no load error
        assert hit.hit >= sizes[0] - CHUNK, hit
        log = server.log_text()
        assert ASYNC_LINE.format(req=hit.request_id) in log, "the hit was not loaded asynchronously"
        assert warm["choices"][0]["text"] == ref.complete(first, max_tokens=16)["choices"][0]["text"]
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert stream.generated == DECODE_TOKENS

        # A load that fails is recomputed: the warm load put the first prompt back in the CPU tier, so the second
        # prompt's leading chunks are on disk only; their files go (the store still lists them), so the scheduler
        # promises a load that the store cannot serve. The worker reports load errors, vLLM recomputes them.
        removed = [path.unlink() for path in disk_dir.rglob("*.kvc")]
        assert removed
        broken = server.complete(second, max_tokens=16)
        assert server.hit_for(broken).load > 0, "the scheduler promised no load: nothing was tried"
        wait_until(lambda: server.load_errors(broken), WAIT_S, interval=0.2, what="the load errors of the lost chunks")
        expected = ref.complete(second, max_tokens=16)["choices"][0]["text"]
        assert broken["choices"][0]["text"] == expected

        # What vLLM recomputed is stored (never what the failed load left), so the same prompt again is a proven
        # load of the whole prompt with the same output.
        wait_until(lambda: server.stored_tokens(broken) >= sizes[1] - CHUNK, WAIT_S, interval=0.2,
                   what="the recomputed chunks stored")
        again = server.complete(second, max_tokens=16)
        hit = server.assert_loaded(again)
        assert hit.hit >= sizes[1] - CHUNK, hit
        assert again["choices"][0]["text"] == expected

        # the timeline, for the reader (not asserted)
        events = [(m["when"], m["what"]) for m in KVMESH_TIME.finditer(log)
                  if (m["req"] or m["req2"] or "").startswith(warm["id"])]
        assert any(what.startswith("Loading") for _, what in events), events  # the worker's side of the async path
        during = [t for t in stream.times if sent <= t <= answered]
        print(f"\nwarm request sent {clock(sent)}, answered {clock(answered)}; its load: {events}")
        print(f"decoding request: {stream.generated} tokens in {len(stream.times)} pieces from "
              f"{clock(stream.times[0])} to {clock(stream.times[-1])}; "
              f"{len(during)} of them while the warm request was in flight: {[clock(t) for t in during[:40]]}")
    finally:
        for started in (server, ref):
            started.stop()
