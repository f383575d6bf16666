"""The extras of vLLM's own `Request` objects (multimodal items, prompt embeds, LoRA, cache_salt) key chunks apart.

These are vLLM 0.32's real classes (`vllm.v1.request.Request`, `MultiModalFeatureSpec`, `LoRARequest`); the
keys are the engine's (`ChunkHasher` over `request_extras`). What must hold, as for vLLM's own block hashes:
different inputs give different keys from the first affected chunk on, identical inputs identical keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.services.engine.adapter.request_extras import LoraIdentities, request_extras
from kvmesh.shared.wire.keys import ChunkHasher, KeyParams

vllm_request = pytest.importorskip("vllm.v1.request")
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

CHUNK = 16
HASHER = ChunkHasher(KeyParams("tiny", "float32/TOK-2x64"), CHUNK)
TOKENS = list(range(100, 164))  # 4 chunks of 16


def make_request(tokens: list[int] | None = TOKENS, **fields: object) -> "vllm_request.Request":
    return vllm_request.Request("r", tokens, SamplingParams(max_tokens=4), None, **fields)


def keys_of(request: "vllm_request.Request") -> list[bytes]:
    tokens = list(request.all_token_ids)
    return HASHER.keys(tokens, request_extras(request, CHUNK))


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_plain_request_has_no_extras_and_plain_keys() -> None:
    request = make_request()
    assert request_extras(request, CHUNK) is None
    assert keys_of(request) == HASHER.keys(TOKENS)


def test_multimodal_items_key_chunks_apart_from_the_first_affected_chunk() -> None:
    cat = keys_of(make_request(mm_features=[image("cat-hash", 20, 8)]))  # placeholders in chunk 1
    dog = keys_of(make_request(mm_features=[image("dog-hash", 20, 8)]))
    again = keys_of(make_request(mm_features=[image("cat-hash", 20, 8)]))
    plain = HASHER.keys(TOKENS)
    assert cat == again
    assert cat[0] == dog[0] == plain[0]
    assert all(c != d for c, d in zip(cat[1:], dog[1:]))
    # two items, given out of order: sorted by offset, the same keys
    both = keys_of(make_request(mm_features=[image("a", 20, 8), image("b", 40, 4)]))
    both_reversed = keys_of(make_request(mm_features=[image("b", 40, 4), image("a", 20, 8)]))
    assert both == both_reversed and both[:2] == keys_of(make_request(mm_features=[image("a", 20, 8)]))[:2]


def test_prompt_embeds_key_chunks_by_their_content() -> None:
    torch.manual_seed(0)
    embeds = torch.randn(40, 8)
    other = embeds.clone()
    other[20] += 1.0  # chunk 1 differs
    first = make_request(None, prompt_embeds=embeds)
    assert list(first.all_token_ids) == [0] * 40  # vLLM's placeholder ids: the tokens say nothing
    a, b = keys_of(first), keys_of(make_request(None, prompt_embeds=other))
    assert keys_of(make_request(None, prompt_embeds=embeds.clone())) == a
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[0] != HASHER.keys([0] * 40)[0], "a prompt-embeds request never shares keys with token ids 0"
    half = make_request(None, prompt_embeds=embeds.to(torch.bfloat16))
    assert keys_of(half)[0] != a[0], "the dtype counts"


def write_adapter(directory: Path, weights: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text('{"r": 8, "target_modules": ["k_proj"]}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    (directory / "README.md").write_text("not part of the identity")
    return directory


def test_lora_identity_is_the_adapter_files_content(tmp_path: Path) -> None:
    identities = LoraIdentities()
    a = write_adapter(tmp_path / "a", b"weights-a")
    copy_of_a = write_adapter(tmp_path / "copy-of-a", b"weights-a")
    b = write_adapter(tmp_path / "b", b"weights-b")
    id_a = identities.identity("a", str(a))
    assert id_a.startswith("files:")
    assert identities.identity("other-name", str(copy_of_a)) == id_a, "same files: same KV, wherever they are"
    assert identities.identity("a", str(b)) != id_a, "a name re-pointed at other weights does not hit"
    (a / "README.md").write_text("changed")
    assert identities.identity("a", str(a)) == id_a
    (a / "adapter_model.safetensors").write_bytes(b"weights-a, retrained")
    assert identities.identity("a", str(a)) != id_a, "weights rewritten in place are noticed"
    hub = identities.identity("a", "some-org/some-adapter")  # not on this host: vLLM's (name, path)
    assert hub.startswith("name:") and hub != identities.identity("b", "some-org/some-adapter")


def test_lora_and_cache_salt_requests_get_their_own_keys(tmp_path: Path) -> None:
    a = write_adapter(tmp_path / "a", b"weights-a")
    b = write_adapter(tmp_path / "b", b"weights-b")
    with_a = keys_of(make_request(lora_request=LoRARequest("a", 1, str(a))))
    with_b = keys_of(make_request(lora_request=LoRARequest("b", 2, str(b))))
    plain = HASHER.keys(TOKENS)
    assert len(set(with_a) | set(with_b) | set(plain)) == 3 * len(plain)
    assert keys_of(make_request(lora_request=LoRARequest("a", 1, str(a)))) == with_a
    s1 = keys_of(make_request(cache_salt="s1"))
    assert len(set(s1) | set(keys_of(make_request(cache_salt="s2"))) | set(plain)) == 3 * len(plain)
    assert keys_of(make_request(cache_salt="s1")) == s1
