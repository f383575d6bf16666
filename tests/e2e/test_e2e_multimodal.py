"""End to end with images (real vLLM CPU servers): KVMesh never loads the KV of one image for another.

The "vision" model (scripts/make_demo_model.py: Idefics3, a tiny vision tower in front of a demo-sized Llama, 64
image tokens per image) is served twice: with KVMeshConnector (CPU tier only) and without a connector (the
reference). vLLM's prefix cache is off, so whatever a request does not compute came from KVMesh.

A chat request holds text, one image, then more text, so the image's placeholder tokens sit in a middle chunk.
The prompts of image A and image B are the SAME token ids (an image becomes a fixed run of placeholder tokens);
only vLLM's content hash of the image, which the connector mixes into the keys of the chunks that overlap the
placeholders (services/engine/adapter/request_extras.py, shared/wire/keys.py `KeyExtras`), tells them apart:

1. image A, cold: no hit; the answer is the reference's for A.
2. image B, same text: the hit stops at the start of the chunk holding the image (the text chunks before it are
   the same KV for both images, and are loaded); the answer is the reference's for B, which differs from A's.
3. image A again: a real load of at least everything up to the last full chunk; the reference's answer for A.
4. image B again: the same for B (the chunks stored for B in 2 are B's).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from support.e2e import VLLMServer, clean_env, free_port, kv_transfer_config, make_demo_model, start_vllm

pytestmark = pytest.mark.vllm

CHUNK = 256
YAML = f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.25\n"
MAX_TOKENS = 16


def image_url(kind: str, size: int = 128) -> str:
    """A PNG data URL: "a" red with white horizontal stripes, "b" a blue and yellow checkerboard."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (220, 20, 20) if kind == "a" else (20, 40, 220))
    draw = ImageDraw.Draw(image)
    step = size // 8
    for i in range(8):
        for j in range(8):
            if kind == "a" and i % 2 == 0:
                draw.rectangle([0, i * step, size - 1, (i + 1) * step - 1], fill=(255, 255, 255))
            elif kind == "b" and (i + j) % 2 == 0:
                draw.rectangle([j * step, i * step, (j + 1) * step - 1, (i + 1) * step - 1], fill=(240, 220, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(text: str, kind: str) -> list[dict[str, Any]]:
    """User message: the first half of `text`, the image, the second half (the template keeps this order)."""
    half = len(text) // 2
    return [{"role": "user", "content": [
        {"type": "text", "text": text[:half]},
        {"type": "image_url", "image_url": {"url": image_url(kind)}},
        {"type": "text", "text": text[half:] + "\n\nDescribe the image."},
    ]}]


def chat(server: VLLMServer, msgs: list[dict[str, Any]]) -> dict[str, Any]:
    import httpx

    body = {"model": server.model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def content(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["message"]["content"]


def chat_tokens(server: VLLMServer, msgs: list[dict[str, Any]]) -> list[int]:
    """The prompt token ids vLLM runs for a chat (/tokenize renders the template and expands the image)."""
    import httpx

    response = httpx.post(f"{server.url}/tokenize", json={"model": server.model, "messages": msgs}, timeout=120)
    response.raise_for_status()
    return list(response.json()["tokens"])


def vision_token_ids(model: Path) -> set[int]:
    """Ids of the image's placeholder tokens (`<fake_token_around_image>`, `<global-img>`, `<image>`)."""
    added = {t["content"]: t["id"] for t in json.loads((model / "tokenizer.json").read_text())["added_tokens"]}
    return {added[name] for name in make_demo_model.VISION_TOKENS if name != "<end_of_utterance>"}


@pytest.fixture(scope="module")
def vision_servers(tmp_path_factory: pytest.TempPathFactory, vision_model: Path) -> Iterator[dict[str, VLLMServer]]:
    work = tmp_path_factory.mktemp("multimodal")
    (work / "kvmesh.yaml").write_text(YAML)
    env = clean_env(LMCACHE_CONFIG_FILE=str(work / "kvmesh.yaml"))
    servers = {
        "mesh": VLLMServer("vllm-vision", vision_model, free_port(), work / "vision.log",
                           kv_config=kv_transfer_config(), env=env),
        "ref": VLLMServer("vllm-vision-ref", vision_model, free_port(), work / "vision-ref.log"),
    }
    try:
        start_vllm(*servers.values(), timeout=600)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_kv_of_one_image_is_never_loaded_for_another(vision_servers: dict[str, VLLMServer], vision_model: Path,
                                                     long_text: str) -> None:
    server, ref = vision_servers["mesh"], vision_servers["ref"]
    text = long_text[30_000:35_000]  # ~1.2k tokens around the image
    msgs_a, msgs_b = messages(text, "a"), messages(text, "b")

    tokens = chat_tokens(server, msgs_a)
    assert chat_tokens(server, msgs_b) == tokens, "A and B must differ only in the image, not in token ids"
    placeholders = [i for i, t in enumerate(tokens) if t in vision_token_ids(vision_model)]
    assert placeholders, "no image placeholder tokens in the prompt"
    first, last = placeholders[0], placeholders[-1]
    image_chunk = first // CHUNK * CHUNK  # the start of the chunk holding the first placeholder token
    last_full = len(tokens) // CHUNK * CHUNK
    # at least one whole text chunk before the image, and the image is not in the last chunk
    assert image_chunk >= CHUNK and last // CHUNK < (len(tokens) - 1) // CHUNK, (first, last, len(tokens))

    expected_a, expected_b = content(chat(ref, msgs_a)), content(chat(ref, msgs_b))
    assert expected_a != expected_b, "the random model answers the same for both images: the test would be blind"

    cold = chat(server, msgs_a)
    assert cold["usage"]["prompt_tokens"] == len(tokens)
    assert server.hit_for(cold).hit == 0
    assert content(cold) == expected_a

    other = chat(server, msgs_b)
    hit_b = server.hit_for(other)
    assert hit_b.total == len(tokens)
    assert hit_b.hit <= image_chunk, f"image B hit {hit_b.hit} tokens: KV of image A (from {image_chunk}) reused"
    assert content(other) == expected_b
    # the text before the image is the same KV for both images, so its whole chunks are loaded, and really
    assert hit_b.hit == image_chunk, hit_b
    server.assert_loaded(other)

    warm = chat(server, msgs_a)
    hit_a = server.assert_loaded(warm)
    assert hit_a.hit >= last_full, hit_a
    assert content(warm) == expected_a

    warm_b = chat(server, msgs_b)
    assert server.assert_loaded(warm_b).hit >= last_full
    assert content(warm_b) == expected_b
