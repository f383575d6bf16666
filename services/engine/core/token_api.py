"""LMCache's cache engine API by tokens (docs/compatibility.md): store / retrieve / lookup / prefetch, and pin /
unpin / clear, on one worker's `CacheEngine`.

No production path calls these: the connector names chunks by the chain keys its scheduler computed once per
request (the engine's chunk API: `CacheEngine.chunk_spans`, then its one load entry `load` and one save entry
`save`, which these call too). Tests and benchmarks drive an engine through them, hashing tokens into chunk keys
with the engine's `ChunkHasher`. Every call runs on the caller's thread and waits for the NATS loop only with
bounded timeouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.chunk_load import layer_list
from kvmesh.services.engine.core.storage_manager import ALL_LOCATIONS
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, LOCATIONS, PEER, REMOTE
from kvmesh.shared.wire.keys import KeyExtras

Tokens = torch.Tensor | Sequence[int]
# The cache engine API names the CPU tier "Hot" in lookup's search_range (docs/compatibility.md).
LOCATION_ALIASES = {"Hot": LOCAL_CPU, "LocalCPUBackend": LOCAL_CPU, "LocalDiskBackend": LOCAL_DISK,
                    "RemoteBackend": REMOTE, "P2PBackend": PEER}


def store(engine: CacheEngine, tokens: Tokens, mask: torch.Tensor | None = None, **kv: Any) -> None:
    """Copy the KV of `tokens` (the chunks a mask selects) out of vLLM's paged cache.

    kwargs: `kv_caches` (list or dict of per-layer tensors), `slot_mapping` (one slot per token) and optional
    `extras` (`KeyExtras`: what besides the tokens made this KV, e.g. a LoRA adapter). Chunks already held (CPU
    tier, or known to be in every lower tier) are not copied again; when the pool is exhausted the remaining
    chunks are skipped (logged). Raises ValueError for a bad mask.
    """
    hasher = engine.ready()[1]
    kv_caches, slot_mapping, _, extras = _kv_args(kv, "store")
    engine.save(hasher.spans(tokens, mask, extras), kv_caches, slot_mapping)


def retrieve(engine: CacheEngine, tokens: Tokens, mask: torch.Tensor | None = None, **kv: Any) -> torch.Tensor:
    """Load the cached prefix of `tokens` (after the mask's False prefix) into vLLM's paged cache.

    kwargs: `kv_caches`, `slot_mapping`, optional `skip_prefix` (leading tokens of the sequence that vLLM already
    holds: retrieved but not written) and `extras` (as for `store`). Returns a CPU bool mask, True for retrieved
    tokens.
    """
    hasher = engine.ready()[1]
    kv_caches, slot_mapping, skip_prefix, extras = _kv_args(kv, "retrieve")
    spans = hasher.spans(tokens, mask, extras)
    retrieved = torch.zeros(len(tokens), dtype=torch.bool)
    loaded = engine.load(spans, slot_mapping).scatter(kv_caches, slot_mapping, skip_prefix)
    if loaded:
        retrieved[spans[0].start:spans[loaded - 1].end] = True
    return retrieved


def lookup(engine: CacheEngine, tokens: Tokens, search_range: list[str] | None = None,
           extras: KeyExtras | None = None) -> int:
    """How many prefix tokens are cached, across the tiers in `search_range` (all by default).

    Tier names: "LocalCPUBackend" (the API's "Hot"), "LocalDiskBackend", "RemoteBackend", "P2PBackend" (with
    enable_p2p: other instances' CPU tiers). Chunks may sit in different tiers; the answer is the contiguous
    prefix over all of them.
    """
    _, hasher, _, storage, _ = engine.ready()
    spans = hasher.spans(tokens, extras=extras)
    held = storage.lookup(spans, searched_locations(search_range))
    return spans[held - 1].end if held else 0


def prefetch(engine: CacheEngine, tokens: Tokens, mask: torch.Tensor | None = None,
             extras: KeyExtras | None = None) -> None:
    """Start loading the lower tiers' prefix of `tokens` into the CPU tier; returns at once."""
    _, hasher, _, storage, _ = engine.ready()
    storage.prefetch(hasher.spans(tokens, mask, extras), engine.meta_mismatch)


# ---- controller-style operations (the worker agent runs the same dispatch for the controller) ----------------
def pin(engine: CacheEngine, tokens: Tokens, location: str = LOCAL_CPU, ttl_secs: float | None = None,
        extras: KeyExtras | None = None) -> int:
    """Pin the held prefix of `tokens` at `location` (until unpinned, or `ttl_secs`); tokens pinned."""
    return _command(engine, "pin", location, tokens, ttl_secs, extras)


def unpin(engine: CacheEngine, tokens: Tokens, location: str = LOCAL_CPU, extras: KeyExtras | None = None) -> int:
    return _command(engine, "unpin", location, tokens, None, extras)


def clear(engine: CacheEngine, location: str = LOCAL_CPU) -> int:
    """Clear `location`: the CPU tier entirely; a lower store as its clear allows (see the store)."""
    return _command(engine, "clear", location, [])


def _command(engine: CacheEngine, op: str, location: str, tokens: Tokens, ttl_secs: float | None = None,
             extras: KeyExtras | None = None) -> int:
    layout, hasher, _, storage, _ = engine.ready()
    if location not in LOCATIONS:
        raise ValueError(f"unknown location {location!r} (known: {', '.join(LOCATIONS)})")
    spans, states = hasher.spans_and_states(tokens, extras, layout.state_block) if op != "clear" else ([], [])
    if location != LOCAL_CPU and not (storage.lower(location) is not None and storage.lower_ready()):
        return 0  # a lower tier that is not configured, or not reachable now (NATS down): at once
    command = storage.commands.run(op, location, spans, ttl_secs, states)
    if engine.nats_loop is None:  # no mesh: only the CPU tier, whose commands never wait on anything
        return asyncio.run(command)
    return engine.nats_loop.call(command, engine.config.request_timeout_secs + 6.0, default=0)


def searched_locations(search_range: Sequence[str] | None) -> frozenset[str]:
    """The locations a lookup's `search_range` names (all, by default), by the names LMCache gives its tiers."""
    if search_range is None:
        return ALL_LOCATIONS
    out = set()
    for name in search_range:
        if name not in LOCATION_ALIASES:
            raise ValueError(f"search_range: unknown location {name!r} (known: {', '.join(LOCATION_ALIASES)})")
        out.add(LOCATION_ALIASES[name])
    return frozenset(out)


def _kv_args(kv: dict[str, Any], op: str) -> tuple[list[torch.Tensor], torch.Tensor, int, KeyExtras | None]:
    unknown = set(kv) - {"kv_caches", "slot_mapping", "skip_prefix", "extras"}
    if unknown:
        raise TypeError(f"{op}: unexpected keyword arguments {sorted(unknown)}")
    if "kv_caches" not in kv or "slot_mapping" not in kv:
        raise ValueError(f"{op}: kv_caches= and slot_mapping= are required")
    caches = layer_list(kv["kv_caches"])
    slot_mapping = kv["slot_mapping"]
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise ValueError(f"{op}: slot_mapping must be a 1-D tensor")
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    skip_prefix = int(kv.get("skip_prefix") or 0)
    if skip_prefix < 0:
        raise ValueError(f"{op}: skip_prefix must be >= 0, got {skip_prefix}")
    extras = kv.get("extras")
    if extras is not None and not isinstance(extras, KeyExtras):
        raise TypeError(f"{op}: extras must be a KeyExtras, got {type(extras).__name__}")
    return caches, slot_mapping, skip_prefix, extras
