"""`kvmesh pd-proxy` (services/pd_proxy) without vLLM: what it sends a producer, and how it refuses bodies it will
not forward (the proxy against real producer and consumer vLLMs: tests/e2e/test_e2e_gate.py). Also the PD hint a
consumer reads from its request (services/engine/adapter/pd.py): client input, so anything malformed is no hint."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.services.engine.adapter.pd import PEER_FIELD, peer_hint, producer_params, wants_remote_decode
from kvmesh.services.pd_proxy.__main__ import parse_args
from kvmesh.services.pd_proxy.proxy import ProxyConfig, build_app, prefill_body


def test_the_producer_computes_only_the_prompt_and_is_asked_to_hand_its_kv_on() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 40, "max_completion_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0}
    sent = prefill_body(body)
    assert sent == {"model": "m", "prompt": "p", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                    "temperature": 0, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    assert body["max_tokens"] == 40 and body["stream"] is True  # the consumer's request keeps the client's


async def test_bodies_it_will_not_forward_are_refused_with_the_reason() -> None:
    # the vLLM URLs are never reached: each body is refused before any request goes out
    app = build_app(ProxyConfig(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], max_body_bytes=1000))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            too_large = await client.post("/v1/completions", content=b"{" + b" " * 2000 + b"}",
                                          headers={"content-type": "application/json"})
            assert too_large.status_code == 413 and "--max-body-bytes" in too_large.json()["detail"]
            not_json = await client.post("/v1/completions", content=b"prompt=hi")
            assert not_json.status_code == 400 and "not JSON" in not_json.json()["detail"]
            a_list = await client.post("/v1/chat/completions", json=[1, 2])
            assert a_list.status_code == 400 and "JSON object" in a_list.json()["detail"]
            health = (await client.get("/healthz")).json()
            assert health["requests"] == 0 and health["prefill_failures"] == 0


def test_flags_need_both_sides_and_positive_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    _, config = parse_args(["--prefill", "http://p:1/", "--decode", "http://d:2", "--decode", "http://e:3"])
    assert config.producers == ["http://p:1"] and config.consumers == ["http://d:2", "http://e:3"]
    for argv in (["--decode", "http://d:2"], ["--prefill", "http://p:1", "--decode", "http://d:2", "--timeout", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "--timeout must be > 0" in capsys.readouterr().err


def test_a_consumer_takes_only_a_well_formed_producer_hint() -> None:
    params = producer_params("prefill-0", ["prefill-0@1-aa", "prefill-0.r1@2-bb"], 512)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    hint = peer_hint(params)
    assert hint is not None and hint.instance_id == "prefill-0" and hint.worker_of(1) == "prefill-0.r1@2-bb"
    assert hint.worker_of(2) is None
    assert wants_remote_decode({"do_remote_decode": True}) and not wants_remote_decode({"do_remote_decode": "yes"})
    good = params[PEER_FIELD]
    for bad in (None, {}, {"do_remote_prefill": False, PEER_FIELD: good},
                {"do_remote_prefill": True, PEER_FIELD: "prefill-0"},
                {"do_remote_prefill": True, PEER_FIELD: {**good, "workers": []}},
                {"do_remote_prefill": True, PEER_FIELD: {**good, "workers": [7]}},
                {"do_remote_prefill": True, PEER_FIELD: {**good, "instance_id": "x" * 300}},
                {"do_remote_prefill": True, PEER_FIELD: {**good, "workers": ["w"] * 2000}}):
        assert peer_hint(bad) is None, bad
