"""Chunk keys: deterministic across processes, prefix-chained, mask rules of the cache engine API (docs/compatibility.md)."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvmesh.shared.wire.keys import KEY_BYTES, ChunkHasher, KeyExtras, KeyParams, chunk_spans, num_masked_prefix

PARAMS = KeyParams(model="meta-llama/Llama-3.1-8B-Instruct", kv_format="bfloat16/LBHNC-128")

KEYS_SCRIPT = """
from kvmesh.shared.wire.keys import ChunkHasher, KeyParams
h = ChunkHasher(KeyParams("meta-llama/Llama-3.1-8B-Instruct", "bfloat16/LBHNC-128"), 256)
print(",".join(k.hex() for k in h.keys(list(range(1000)))))
"""


def test_keys_identical_across_processes_with_different_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", KEYS_SCRIPT], env=env, capture_output=True, text=True,
                                check=True, timeout=60)
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1
    expected = ",".join(k.hex() for k in ChunkHasher(PARAMS, 256).keys(list(range(1000))))
    assert outputs == {expected}


def test_chunks_cover_tokens_and_partial_last_chunk() -> None:
    hasher = ChunkHasher(PARAMS, 256)
    spans = hasher.spans(list(range(600)))
    assert [(s.start, s.end) for s in spans] == [(0, 256), (256, 512), (512, 600)]
    assert [s.num_tokens for s in spans] == [256, 256, 88]
    no_unfull = ChunkHasher(PARAMS, 256, save_unfull_chunk=False).spans(list(range(600)))
    assert [(s.start, s.end) for s in no_unfull] == [(0, 256), (256, 512)]
    assert [s.key for s in no_unfull] == [s.key for s in spans[:2]]


def test_seed_000_prompt_is_one_partial_chunk() -> None:
    tokens = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]
    spans = ChunkHasher(PARAMS, 256).spans(tokens)
    assert len(spans) == 1 and spans[0].num_tokens == 12


def test_key_depends_on_prefix_params_and_tokens() -> None:
    hasher = ChunkHasher(PARAMS, 4)
    a = hasher.keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1], "a different first chunk changes every later key"
    assert hasher.keys([1, 2, 3, 4]) == a[:1], "a prefix's keys are the prefix of the keys"
    other_rank = ChunkHasher(KeyParams(PARAMS.model, PARAMS.kv_format, world_size=2, rank=1), 4)
    other_format = ChunkHasher(KeyParams(PARAMS.model, "float16/NHD"), 4)
    assert other_rank.keys([1, 2, 3, 4]) != a[:1] and other_format.keys([1, 2, 3, 4]) != a[:1]
    assert all(len(k) == 16 for k in a)


def test_token_containers_agree() -> None:
    hasher = ChunkHasher(PARAMS, 256)
    tokens = list(np.random.default_rng(0).integers(0, 128_000, 1000))
    expected = hasher.keys([int(t) for t in tokens])
    assert hasher.keys(np.array(tokens, dtype=np.int32)) == expected
    assert hasher.keys(torch.tensor(tokens, dtype=torch.long)) == expected


def test_mask_skips_prefix_chunks_but_keeps_keys() -> None:
    hasher = ChunkHasher(PARAMS, 4)
    tokens = list(range(10))
    mask = torch.tensor([False] * 4 + [True] * 6)
    spans = hasher.spans(tokens, mask)
    assert [(s.start, s.end) for s in spans] == [(4, 8), (8, 10)]
    assert [s.key for s in spans] == hasher.keys(tokens)[1:]


@pytest.mark.parametrize("mask, message", [
    ([False, False, True, True, True, True], "multiple of chunk_size"),
    ([True, False, True, True, True, True], "only as a prefix"),
    ([True] * 5, "shape"),
])
def test_bad_masks_raise(mask: list[bool], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        num_masked_prefix(mask, 6, 4)


def test_all_false_mask_stores_nothing() -> None:
    assert ChunkHasher(PARAMS, 4).spans(list(range(8)), [False] * 8) == []


# ---- what besides the tokens changes the KV: KeyExtras ----------------------------------------------------
TOKENS = list(range(1000))  # chunks of 256: [0,256) [256,512) [512,768) [768,1000)


def test_plain_keys_are_unchanged_by_the_extras_scheme() -> None:
    """Golden keys of the plain scheme (computed before KeyExtras existed): a text request keeps its keys."""
    golden = ["c63df7a4c7f581acc8c3d6142f161d21", "f7c8d60c8c8d8ae6648d68f613ebc697",
              "81a868a49f3e2db0701d7b5fa72f1c07"]
    hasher = ChunkHasher(PARAMS, 256)
    assert [k.hex() for k in hasher.keys(list(range(600)))] == golden
    assert [k.hex() for k in hasher.keys(list(range(600)), KeyExtras())] == golden


def test_lora_changes_every_chunk_and_is_stable() -> None:
    hasher = ChunkHasher(PARAMS, 256)
    plain = hasher.keys(TOKENS)
    a = hasher.keys(TOKENS, KeyExtras(lora_id="files:aaaa"))
    b = hasher.keys(TOKENS, KeyExtras(lora_id="files:bbbb"))
    assert all(x != y for x, y in zip(plain, a)) and all(x != y for x, y in zip(a, b))
    assert hasher.keys(TOKENS, KeyExtras(lora_id="files:aaaa")) == a


def test_cache_salt_is_mixed_into_the_first_chunk_and_carried_by_the_chain() -> None:
    hasher = ChunkHasher(PARAMS, 256)
    plain = hasher.keys(TOKENS)
    s1 = hasher.keys(TOKENS, KeyExtras(cache_salt="s1"))
    s2 = hasher.keys(TOKENS, KeyExtras(cache_salt="s2"))
    assert len(set(plain) | set(s1) | set(s2)) == 3 * len(plain)
    assert hasher.keys(TOKENS[:512], KeyExtras(cache_salt="s1")) == s1[:2], "a prefix's keys stay a prefix"


def mm(*items: tuple[str, int, int]) -> KeyExtras:
    return KeyExtras(mm_identifiers=[i for i, _, _ in items], mm_offsets=[o for _, o, _ in items],
                     mm_lengths=[n for _, _, n in items])


def test_multimodal_item_changes_keys_from_its_first_chunk_on() -> None:
    hasher = ChunkHasher(PARAMS, 256)
    plain = hasher.keys(TOKENS)
    cat = hasher.keys(TOKENS, mm(("cat", 300, 100)))  # placeholder tokens [300, 400): chunk 1
    dog = hasher.keys(TOKENS, mm(("dog", 300, 100)))
    assert cat[0] == dog[0] == plain[0], "chunks before the item keep their keys (shared prefix)"
    assert all(c != d for c, d in zip(cat[1:], dog[1:])), "another picture: every chunk from the item on differs"
    assert hasher.keys(TOKENS, mm(("cat", 300, 100))) == cat, "the same picture: the same keys"
    assert hasher.keys(TOKENS, mm(("cat", 310, 100)))[1] != cat[1], "the offset inside the chunk counts"
    across = hasher.keys(TOKENS, mm(("cat", 200, 100)))  # [200, 300): chunks 0 and 1
    assert across[0] != plain[0] and across[1] != hasher.keys(TOKENS, mm(("dog", 200, 100)))[1]
    two = hasher.keys(TOKENS, mm(("cat", 300, 100), ("dog", 600, 50)))
    assert two[:2] == cat[:2] and two[2] != cat[2]


def test_prompt_embeds_digests_per_chunk() -> None:
    hasher = ChunkHasher(PARAMS, 256)
    zeros = [0] * 600  # vLLM's token ids of a prompt-embeds request
    x = hasher.keys(zeros, KeyExtras(embeds_digests=[b"x0", b"x1", b"x2"]))
    y = hasher.keys(zeros, KeyExtras(embeds_digests=[b"x0", b"y1", b"x2"]))
    assert x[0] == y[0] and x[1] != y[1] and x[2] != y[2]
    assert x[0] != hasher.keys(zeros)[0]


def test_extras_never_collide_with_tokens_that_spell_them() -> None:
    """A chunk keyed with extras is hashed under its own personalisation, length-prefixed: tokens chosen to
    spell the extras' bytes give another key."""
    hasher = ChunkHasher(PARAMS, 4, save_unfull_chunk=True)
    extras = KeyExtras(cache_salt="s")
    encoded = extras.chunk_extras(0, 0, 2)
    assert encoded is not None
    padded = encoded + b"\0" * (-len(encoded) % 8)
    spelled = list(np.frombuffer(padded, dtype="<i8"))
    assert hasher.keys([1, 2], extras)[0] not in hasher.keys(spelled + [1, 2])


@pytest.mark.parametrize("bad, message", [
    (dict(mm_identifiers=["a"], mm_offsets=[], mm_lengths=[1]), "differ in length"),
    (dict(mm_identifiers=["a"], mm_offsets=[-1], mm_lengths=[1]), ">= 0"),
    (dict(mm_identifiers=["a"], mm_offsets=[0], mm_lengths=[0]), "> 0"),
])
def test_inconsistent_extras_are_refused(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyExtras(**bad)


def test_extras_round_trip_the_wire_and_bad_ones_are_protocol_errors() -> None:
    from kvmesh.shared import protocol
    from kvmesh.shared.errors import ProtocolError

    extras = KeyExtras(lora_id="files:ab", cache_salt="s", mm_identifiers=["h"], mm_offsets=[3], mm_lengths=[4],
                       embeds_digests=[b"\x01" * 16])
    command = protocol.WorkerCommand(op="pin", location="LocalCPUBackend", tokens=[1, 2], extras=extras)
    assert protocol.decode(protocol.encode(command), protocol.WorkerCommand) == command
    import msgpack

    body = msgpack.unpackb(protocol.encode(command))
    body["extras"]["mm_offsets"] = []
    with pytest.raises(ProtocolError, match="differ in length"):
        protocol.decode(msgpack.packb(body), protocol.WorkerCommand)
    body["extras"] = {"mm_offsets": "x"}
    with pytest.raises(ProtocolError):
        protocol.decode(msgpack.packb(body), protocol.WorkerCommand)


def test_a_sharing_domain_other_than_the_default_changes_every_key() -> None:
    """Issue 24: two honest tenants in different domains never share a key; the default domain's keys are the
    same bytes as before domains existed."""
    default = KeyParams(model="m", kv_format="f")
    assert KeyParams(model="m", kv_format="f", domain="default").root() == default.root()
    assert default.root() == hashlib.blake2b(b"kvmesh/1|m|f|1|0", digest_size=KEY_BYTES).digest()
    roots = {KeyParams(model="m", kv_format="f", domain=name).root() for name in ("default", "tenant-a", "tenant-b")}
    assert len(roots) == 3


def test_chunk_spans_from_a_later_chunk_are_the_tail_of_the_whole_sequences() -> None:
    keys = [bytes([i]) * 16 for i in range(5)]
    whole = chunk_spans(keys, 4 * 256 + 10, 256)
    assert [span.end for span in whole] == [256, 512, 768, 1024, 1034]
    for first in range(6):
        assert chunk_spans(keys, 4 * 256 + 10, 256, first) == whole[first:]
