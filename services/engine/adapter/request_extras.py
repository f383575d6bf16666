"""What besides its token ids changes a vLLM request's KV, as `KeyExtras` for its chunk keys.

Runs in the scheduler (the connector's `get_num_new_matched_tokens`), once per request; the worker receives
the result with the request's metadata. It reads from vLLM's `Request` what vLLM's own prefix cache mixes
into its block hashes (`generate_block_hash_extra_keys` in vllm/v1/core/kv_cache_utils.py):

  * `lora_request`: the adapter's identity. vLLM uses (name, path); our cache outlives the process (disk,
    remote store), so a name or a path re-pointed at other weights between two runs must not hit. The
    identity is therefore a digest of the files vLLM loads from the adapter directory (cached per file size
    and mtime, so a rewritten file is noticed); an adapter whose files are not on this host (a hub id vLLM
    downloads itself) falls back to vLLM's own (name, path).
  * `cache_salt`: mixed into the first chunk, so into the whole chain.
  * `mm_features`: each item's content hash (`identifier`) and placeholder range.
  * `prompt_embeds` (and the token/embedding mask of mixed prompts): a digest per chunk.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from kvmesh.shared.wire.keys import KEY_BYTES, KeyExtras

log = logging.getLogger(__name__)

# The files vLLM reads from a LoRA adapter directory (vllm/lora/lora_model.py, peft_helper.py).
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt",
              "new_embeddings.safetensors", "new_embeddings.bin")


def local_adapter_dir(lora_path: str) -> Path | None:
    """The adapter directory on this host, resolved as vLLM resolves a local path; None if there is none."""
    if not lora_path:
        return None
    path = Path(os.path.expanduser(lora_path))
    return path.resolve() if path.is_dir() else None


class LoraIdentities:
    """Adapter identities by content, computed once per version of the adapter's files (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_dir: dict[Path, tuple[tuple[tuple[str, int, int], ...], str]] = {}

    def identity(self, lora_name: str, lora_path: str) -> str:
        directory = local_adapter_dir(lora_path)
        signature = _file_signature(directory) if directory is not None else ()
        if not signature:
            return "name:" + hashlib.blake2b(f"{lora_name}\0{lora_path}".encode(), digest_size=KEY_BYTES).hexdigest()
        assert directory is not None
        with self._lock:
            cached = self._by_dir.get(directory)
            if cached is not None and cached[0] == signature:
                return cached[1]
        digest = hashlib.blake2b(digest_size=KEY_BYTES)
        for name, size, _ in signature:
            digest.update(f"{name}\0{size}\0".encode())
            with open(directory / name, "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
        identity = "files:" + digest.hexdigest()
        with self._lock:
            self._by_dir[directory] = (signature, identity)
        log.info("LoRA adapter %r (%s): identity %s", lora_name, directory, identity)
        return identity


def _file_signature(directory: Path) -> tuple[tuple[str, int, int], ...]:
    found = []
    for name in LORA_FILES:
        try:
            stat = (directory / name).stat()
        except OSError:
            continue
        found.append((name, stat.st_size, stat.st_mtime_ns))
    return tuple(found)


lora_identities = LoraIdentities()


def prompt_embeds_digests(prompt_embeds: Any, is_token: Any, chunk_size: int) -> list[bytes]:
    """A digest per chunk of the prompt embeddings (torch tensor [n, hidden]) and the token/embeds mask."""
    import torch

    embeds = prompt_embeds.detach().cpu().contiguous()
    digests = []
    for start in range(0, embeds.shape[0], chunk_size):
        rows = embeds[start : start + chunk_size]
        digest = hashlib.blake2b(f"{rows.dtype}|{tuple(rows.shape)}".encode(), digest_size=KEY_BYTES)
        digest.update(rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b"")
        if is_token is not None:
            digest.update(bytes(bool(flag) for flag in is_token[start : start + chunk_size]))
        digests.append(digest.digest())
    return digests


def request_extras(request: Any, chunk_size: int) -> KeyExtras | None:
    """The `KeyExtras` of a vLLM `Request` (None for a plain text request)."""
    lora = getattr(request, "lora_request", None)
    features = sorted(getattr(request, "mm_features", None) or [], key=lambda f: f.mm_position.offset)
    embeds = getattr(request, "prompt_embeds", None)
    extras = KeyExtras(
        lora_id=lora_identities.identity(lora.lora_name, lora.lora_path) if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None) or None,
        mm_identifiers=[str(f.identifier) for f in features],
        mm_offsets=[int(f.mm_position.offset) for f in features],
        mm_lengths=[int(f.mm_position.length) for f in features],
        embeds_digests=(prompt_embeds_digests(embeds, getattr(request, "prompt_is_token_ids", None), chunk_size)
                        if embeds is not None else []),
    )
    return None if extras.empty else extras


def lora_name_of(request: Any) -> str | None:
    lora = getattr(request, "lora_request", None)
    return lora.lora_name if lora is not None else None
