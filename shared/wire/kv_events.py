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

import msgspec

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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
