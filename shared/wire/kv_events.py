"""vLLM's KV event wire format, without vLLM: what a process that must not import vLLM (the controller)
publishes so that vLLM's own decoder and the routers that speak it (llm-d's KV-cache indexer, Dynamo's KV
router) read it.

vLLM (vllm/distributed/kv_events.py) publishes msgpack `KVEventBatch`es: an array [ts, events, dp_rank?], each
event a map tagged with its class name ("type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared") whose
required fields are always written and whose optional ones are left out at their defaults. The structs below
mirror the fields of vLLM 0.32 that KVMesh fills; a decoder that knows more fields takes their defaults.

Block hashes are given as vLLM gives them (`maybe_convert_block_hash`): with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
set (vLLM's default, "1") the key's last 8 bytes as a big-endian int, else the key's bytes. The engine's in-vLLM
events (services/engine/adapter/kv_events.py) and the controller's stream both use `external_hash`, so a
router sees one chunk under one hash on both.
"""

from __future__ import annotations

import os
from typing import Sequence

import msgspec
import numpy as np

USE_INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def use_int_block_hashes() -> bool:
    """Whether block hashes are published as ints: vLLM's own setting, read the way vLLM reads it."""
    return bool(int(os.getenv(USE_INT_BLOCK_HASHES_ENV, "1")))


def external_hash(key: bytes, as_int: bool) -> bytes | int:
    """A chunk key in the form vLLM publishes block hashes: its last 8 bytes as a big-endian int, or its bytes."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1) if as_int else bytes(key)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """An event; encoded as a map tagged "type": <class name>, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- What a router needs of a chunk besides its key --------------------------------------------------------------
# An engine's admission of a chunk it saved may carry it (`AdmissionBatch.described`), so that the controller's
# stream publishes BlockStored events as the engine's own in-vLLM events do. On the wire one description is
# [key, parent key or None, token ids (uint32 little-endian), extra_keys or None, lora_name or None]; extra_keys
# hold digests only (the engine's `event_digest`), never a salt in clear. The controller takes them as untrusted
# input: `parse_description` answers None for anything malformed or over the bounds below.

KEY_BYTES = 16
MAX_EXTRA_KEYS = 64  # LoRA, images in one chunk, salt, embeddings: far fewer in practice
DIGEST_CHARS = 32  # an extra key is a 128-bit digest in hex (the engine's `event_digest`), never a value
HEX = frozenset("0123456789abcdef")
MAX_LORA_NAME = 256


class ChunkDescription(msgspec.Struct, frozen=True, gc=False):  # type: ignore[call-arg]
    parent: bytes | None  # the previous chunk's key (the same shard), None for a sequence's first chunk
    token_ids: bytes  # uint32 little-endian
    extra_keys: tuple[object, ...] | None
    lora_name: str | None

    def tokens(self) -> list[int]:
        return np.frombuffer(self.token_ids, dtype="<u4").tolist()


def pack_tokens(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def description_item(key: bytes, description: ChunkDescription) -> list[object]:
    """`key`'s description in its wire form (an item of `AdmissionBatch.described`)."""
    extras = list(description.extra_keys) if description.extra_keys is not None else None
    return [bytes(key), description.parent, description.token_ids, extras, description.lora_name]


def parse_description(item: object, max_tokens: int) -> tuple[bytes, ChunkDescription] | None:
    """An item of `AdmissionBatch.described` as (key, description), or None when it is malformed or over the bounds
    (at most `max_tokens` tokens: the producer's chunk size)."""
    if not isinstance(item, list) or len(item) != 5:
        return None
    key, parent, token_ids, extras, lora_name = item
    if not (isinstance(key, bytes) and len(key) == KEY_BYTES):
        return None
    if not (parent is None or isinstance(parent, bytes) and len(parent) == KEY_BYTES):
        return None
    if not (isinstance(token_ids, bytes) and 0 < len(token_ids) <= 4 * max_tokens and len(token_ids) % 4 == 0):
        return None
    if not (lora_name is None or isinstance(lora_name, str) and 0 < len(lora_name) <= MAX_LORA_NAME):
        return None
    parsed_extras = _parse_extras(extras)
    if parsed_extras is False:
        return None
    return key, ChunkDescription(parent, token_ids, parsed_extras, lora_name)


def _parse_extras(extras: object) -> tuple[object, ...] | None | bool:
    """vLLM's untagged extra_keys shapes with digests: a digest, or a (digest, offset) pair; False when malformed."""
    if extras is None:
        return None
    if not isinstance(extras, list) or not 0 < len(extras) <= MAX_EXTRA_KEYS:
        return False
    parsed: list[object] = []
    for extra in extras:
        if _digest(extra):
            parsed.append(extra)
        elif (isinstance(extra, list) and len(extra) == 2 and _digest(extra[0]) and isinstance(extra[1], int)
              and not isinstance(extra[1], bool) and 0 <= extra[1] < 1 << 32):
            parsed.append((extra[0], extra[1]))
        else:
            return False
    return tuple(parsed)


def _digest(value: object) -> bool:
    """Whether `value` has a digest's form (what a salt in clear would not have, unless it were one)."""
    return isinstance(value, str) and len(value) == DIGEST_CHARS and HEX.issuperset(value)
