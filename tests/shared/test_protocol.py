"""Wire messages: round trips, and one exception type for every kind of bad input."""

import re

import msgpack
import pytest

from kvmesh.shared import protocol
from kvmesh.shared.errors import ProtocolError
from kvmesh.shared.protocol import Subjects

KEY = bytes(range(16))


def every_message() -> list[object]:
    meta = protocol.ChunkMeta(key=KEY, num_tokens=256, shape=[32, 2, 256, 1024], dtype="bfloat16", fmt="LBHNC-128",
                              nbytes=1 << 25, checksum=123)
    return [
        protocol.Ack(), protocol.Ack(ok=False, error="full"), protocol.HealthRequest(),
        protocol.HealthReply(service="disk_store", service_id="disk-a", details={"pid": 1}),
        protocol.RegisterEngine(worker_id="w", instance_id="i", model="m", kv_format="f", world_size=1, rank=0,
                                chunk_size=256, save_unfull_chunk=True, disk_store="disk-a", remote_stores=["r0"]),
        protocol.RegisterStore(store_id="disk-a", location=protocol.LOCAL_DISK),
        protocol.Heartbeat(producer_id="w", last_seq=3, time=1.5),
        protocol.ControllerHello(controller_id="c", started_at=1.0),
        protocol.AdmissionBatch(producer_id="w", location=protocol.LOCAL_CPU, seq=1, admitted=[KEY], evicted=[]),
        protocol.SyncRequest(reason="gap"),
        protocol.SyncChunk(producer_id="w", location=protocol.LOCAL_CPU, sync_id="s", seq=2, part=0, final=True,
                           keys=[KEY]),
        protocol.WorkerCommand(op="pin", location=protocol.LOCAL_CPU, tokens=[1, 2, 3]),
        protocol.CommandReply(ok=True, num_tokens=12),
        protocol.ChunkKeys(keys=[KEY], num_tokens=[12]), protocol.ContainsReply(prefix=1),
        protocol.ClearRequest(), protocol.StatsRequest(),
        protocol.StatsReply(store_id="s", num_chunks=1, used_bytes=2, capacity_bytes=3),
        meta, protocol.PutRequest(meta=meta, pool="ab" * 16, pool_offset=4096),
        protocol.PutRequest(meta=meta, data=b"x", priority=3, lease_secs=60.5),  # a retained put
        protocol.PrefixLookup(keys=[KEY], num_tokens=12, tiers=[protocol.LOCAL_DISK]),  # a request's load tiers
        protocol.GetRequest(key=KEY, pool="ab" * 16, capacity=1 << 25),
        protocol.GetReply(found=True, meta=meta, data=b"x"),
    ]


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert protocol.decode(protocol.encode(message), type(message)) == message


@pytest.mark.parametrize("payload", [
    b"", b"\xff\xfe garbage", msgpack.packb([1, 2, 3]), msgpack.packb("text"),
    msgpack.packb({"t": "ack"}),  # no version
    msgpack.packb({"v": 99, "t": "ack"}),  # future version
    msgpack.packb({"v": 1, "t": "heartbeat", "producer_id": "w", "last_seq": 1}),  # wrong type
    msgpack.packb({"v": 1, "t": "command_reply"}),  # missing field
    msgpack.packb({"v": 1, "t": "command_reply", "ok": "yes"}),  # mistyped field
    msgpack.packb({"v": 1, "t": "command_reply", "ok": True, "num_tokens": True}),  # bool is not an int
])
def test_bad_payloads_raise_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(payload, protocol.CommandReply)


def test_nested_meta_is_checked() -> None:
    body = msgpack.packb({"v": 1, "t": "put_request", "meta": {"key": KEY}})
    with pytest.raises(ProtocolError, match="missing field"):
        protocol.decode(body, protocol.PutRequest)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    body = msgpack.packb({"v": 1, "t": "command_reply", "ok": True, "num_tokens": 3, "new_field": 1})
    assert protocol.decode(body, protocol.CommandReply) == protocol.CommandReply(ok=True, num_tokens=3)


def test_subjects_are_sanitised() -> None:
    assert Subjects.worker("my.instance *>", "w.r0", "pin") == "kvmesh.worker.my_2einstance_20_2a_3e.w_2er0.pin"
    caller = protocol.Principal.engine("a.b").producer("a.b")
    assert Subjects.store("disk-host", "put", caller) == "kvmesh.store.disk-host.put.engine.a_2eb.a_2eb"
    assert Subjects.caller_of_store_op(Subjects.store("disk-host", "put", caller)) == caller
    with pytest.raises(ValueError):
        Subjects.worker("", "w", "pin")


def test_ids_that_differ_never_share_a_subject_token() -> None:
    ids = ["a.b", "a_b", "a_2eb", "a b", "a*b", "a>b", "ä", "_c3_a4", "a@1", "a_401", "A", "a-b"]
    tokens = [Subjects.token(name) for name in ids]
    assert len(set(tokens)) == len(ids)
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", token) for token in tokens)
    # so two instances whose ids differ only there are two principals: two NATS users, two sets of subjects
    assert protocol.Principal.engine("a.b").path != protocol.Principal.engine("a_b").path


def test_principals_and_the_producer_path_a_subject_names() -> None:
    with pytest.raises(ValueError):
        protocol.Principal("engine")  # an engine needs its instance id
    with pytest.raises(ValueError):
        protocol.Principal("controller", "x")
    with pytest.raises(ValueError):
        protocol.Principal("root", "x")
    path = protocol.Principal.engine("tp").producer("tp.r1")
    sender = Subjects.producer_of(Subjects.register(path), Subjects.REGISTER_ALL)
    assert sender is not None and sender.path == path == "engine.tp.tp_2er1"
    assert sender.owns("tp", "tp.r1") and not sender.owns("other", "tp.r1") and not sender.owns("tp", "tp.r0")
    assert Subjects.producer_of(Subjects.events(protocol.store_path("disk-a")), Subjects.EVENTS_ALL).role == "store"
    # anything that is not <role>.<owner>.<producer> names no sender
    for subject in ("kvmesh.events.engine.tp", "kvmesh.events.controller.x.y", "kvmesh.events.engine.a.b.c",
                    "kvmesh.ctrl.register.engine.a.b"):
        assert Subjects.producer_of(subject, Subjects.EVENTS_ALL) is None


def test_a_token_is_what_token_makes() -> None:
    """Store lanes subscribe `engine.<token>` by the domains map: an instance id with underscores (the default one)
    is a token too, while a dot or a wildcard would match other principals' subjects."""
    from kvmesh.shared.protocol import Subjects

    for name in ("lmcache_default_instance", "vllm-0", "a.b", "a_b", "x y", "*", "é"):
        assert Subjects.is_token(Subjects.token(name)), name
    for text in ("a.b", "*", ">", "a b", "", "a_zz", "a_5"):
        assert not Subjects.is_token(text), text
