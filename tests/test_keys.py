"""Chunk keys: deterministic across processes, prefix-chained, mask rules of seed 003."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvmesh.shared.keys import ChunkHasher, KeyParams, num_masked_prefix

PARAMS = KeyParams(model="meta-llama/Llama-3.1-8B-Instruct", kv_format="bfloat16/LBHNC-128")

KEYS_SCRIPT = """
from kvmesh.shared.keys import ChunkHasher, KeyParams
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
