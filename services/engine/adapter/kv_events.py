"""KV events for routers: KVMesh's CPU-tier admissions and evictions as vLLM's BlockStored / BlockRemoved.

vLLM's scheduler asks the connector for events each step (`take_events`) and publishes them with its own on
its KV event stream (`--kv-events-config`). The workers already report their CPU tier's changes each step
(`CpuTierEvents`, keyed by shard keys); a router also needs each stored block's parent and token ids, which
only the scheduler knows. So `KVEventLog` remembers, for every chunk whose chain key the scheduler computes,
its parent key, tokens, LoRA name and extras (a bounded LRU map, `kv_event_chunks` entries), and turns rank
0's admissions into BlockStored and its evictions into BlockRemoved, one chunk per event:

  * block_hashes: [the chunk's key] and parent_block_hash: its parent's key (None for the first chunk), both
    rank 0's shard key (the chain key itself unless tensor-parallel ranks shard the KV), in the form vLLM
    publishes its own hashes (`maybe_convert_block_hash`): by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    the key's last 8 bytes as a big-endian int, else the 16 key bytes;
  * block_size: chunk_size (a partial last chunk has fewer token_ids), medium "CPU";
  * extra_keys: vLLM's untagged shapes (LoRA name, (multimodal identifier, offset) pairs, cache salt, prompt-
    embedding digest), each value replaced by its digest (`event_digest`), never in clear: the event stream is
    unauthenticated ZMQ, and a salt in clear lets anyone recompute the salted keys of the published token ids.
    Equal values give equal digests on every instance, so a router can still tell requests of one salt (or
    adapter, or image) from another's. A guessable salt stays guessable: the block hash and token ids of a
    first chunk already let anyone test a guess, so the salt must be unguessable (random) to isolate a tenant.
    token_ids stay: routers (llm-d's KV-cache indexer, Dynamo's KV router) hash them into their own block keys
    to match incoming prompts, and they are the requester's own prompt. lora_name stays in clear too: it is the
    served adapter's name (public on /v1/models), which routers use to pick instances that serve it.

An admission of a chunk the map no longer (or never) knew is not published: a BlockStored without tokens
would be useless to a router; nor is its eviction, nor a recurrent state's (a model with Mamba / linear-attention
layers stores one beside each chunk, under a key no router knows): a BlockRemoved is published only for a block
whose BlockStored was. Only rank 0's events are used: every rank holds its shard of the same chunks.
A clear of the CPU tier arrives as evictions, so it is one BlockRemoved per chunk; AllBlocksCleared names no
medium and would tell a router that vLLM's GPU blocks are gone too.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import vllm.envs as envs
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent

from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents
from kvmesh.shared.wire.keys import ChunkKey, ChunkSpan, KeyExtras, KeyParams
from kvmesh.shared.wire import kv_events as wire_events
from kvmesh.shared.wire.kv_events import ChunkDescription, pack_tokens

if TYPE_CHECKING:
    from kvmesh.services.engine.adapter.request_meta import SaveSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkInfo:
    """What a router needs about one chunk besides its key."""

    parent: ChunkKey | None
    token_ids: array  # int64: 8 bytes a token, not a Python int each
    lora_name: str | None
    extra_keys: tuple[object, ...] | None


def event_digest(kind: bytes, value: str | bytes) -> str:
    """What KV events publish for an extra key `value` of `kind` (b"salt", b"lora", b"mm", b"embeds"): a 128-bit
    BLAKE2b digest, hex; the kind keeps a salt's digest from equalling an adapter's of the same text."""
    data = value.encode() if isinstance(value, str) else value
    return hashlib.blake2b(data, digest_size=16, person=b"kvmesh-kv-" + kind).hexdigest()


def extra_keys_of(extras: KeyExtras | None, lora_name: str | None, span: ChunkSpan) -> tuple[object, ...] | None:
    """The untagged parts that `span`'s key mixes in besides its tokens, each as its `event_digest` (vLLM's
    `extra_keys` order: LoRA name, (multimodal identifier, offset in the chunk) pairs, cache salt,
    prompt-embedding digest); None for none."""
    parts: list[object] = [event_digest(b"lora", lora_name)] if lora_name else []
    if extras is not None:
        items = extras.chunk_items(span.start, span.end)
        parts += [(event_digest(b"mm", identifier), offset - span.start) for identifier, offset, _ in items]
        if span.index == 0 and extras.cache_salt:
            parts.append(event_digest(b"salt", extras.cache_salt))
        if span.index < len(extras.embeds_digests):
            parts.append(event_digest(b"embeds", extras.embeds_digests[span.index]))
    return tuple(parts) or None


def save_descriptions(tokens: Sequence[int], keys: Sequence[ChunkKey], save: "SaveSpec", chunk_size: int,
                      extras: KeyExtras | None, lora_name: str | None
                      ) -> tuple[tuple[ChunkKey, ChunkDescription], ...]:
    """With describe_admissions: what the admissions of the chunks `save` stores tell the controller's KV event
    stream (shared/wire/kv_events.py), by chain key: each chunk's parent, tokens, extras as digests (as in these
    events) and LoRA name, the block prefix of the last one too. `keys` are the request's chain keys up to
    `save.end`, `tokens` its tokens from 0."""
    spans = [ChunkSpan(index, index * chunk_size, min((index + 1) * chunk_size, save.end), keys[index])
             for index in range(save.mask_start // chunk_size, min(len(keys), -(-save.end // chunk_size)))]
    if save.prefix_end and save.prefix_key is not None:
        index = (save.prefix_end - 1) // chunk_size
        spans.append(ChunkSpan(index, index * chunk_size, save.prefix_end, save.prefix_key))
    return tuple((span.key, ChunkDescription(keys[span.index - 1] if span.index else None,
                                             pack_tokens(tokens[span.start:span.end]),
                                             extra_keys_of(extras, lora_name, span), lora_name))
                 for span in spans)


class KVEventLog:
    """Scheduler side: chunk metadata noted as chain keys are computed, and the events of the steps since the
    last `take()`."""

    def __init__(self, capacity: int, chunk_size: int) -> None:
        self.capacity = capacity
        self.chunk_size = chunk_size
        self._chunks: OrderedDict[ChunkKey, ChunkInfo] = OrderedDict()  # rank 0's key -> info, LRU order
        self._events: list[KVCacheEvent] = []
        # rank 0's keys whose BlockStored was published and not yet removed (at most what its CPU tier holds): a
        # removal of anything else (a recurrent state, a chunk admitted before it was noted) is not published
        self._published: set[ChunkKey] = set()

    def __len__(self) -> int:
        return len(self._chunks)

    def note(self, spans: Sequence[ChunkSpan], tokens: Sequence[int], params: KeyParams,
             extras: KeyExtras | None, lora_name: str | None, parent: ChunkKey | None) -> None:
        """Remember newly hashed chain spans (in order; `parent` is the chain key before the first of them, if
        any). `tokens` are the request's tokens from 0; `params` rank 0's keying parameters."""
        if self.capacity <= 0:
            return
        for span in spans:
            key = params.shard_key(span.key)
            self._chunks[key] = ChunkInfo(params.shard_key(parent) if parent is not None else None,
                                          array("q", tokens[span.start:span.end]), lora_name,
                                          extra_keys_of(extras, lora_name, span))
            self._chunks.move_to_end(key)
            parent = span.key
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)

    def apply(self, update: CpuTierEvents) -> None:
        """Turn rank 0's admissions and evictions of one step into vLLM events."""
        unknown = 0
        for admitted, key in update.events.get(0, ()):
            if not admitted:
                if key in self._published:
                    self._published.discard(key)
                    self._events.append(BlockRemoved(block_hashes=[external_hash(key)], medium=MEDIUM_CPU))
                continue
            info = self._chunks.get(key)
            if info is None:
                unknown += 1
                continue
            self._published.add(key)
            self._events.append(BlockStored(
                block_hashes=[external_hash(key)],
                parent_block_hash=external_hash(info.parent) if info.parent is not None else None,
                token_ids=info.token_ids.tolist(), block_size=self.chunk_size, lora_id=None, medium=MEDIUM_CPU,
                lora_name=info.lora_name, extra_keys=[info.extra_keys] if info.extra_keys is not None else None))
        if unknown:
            log.debug("%d CPU-tier admission(s) of chunks no longer remembered: not published", unknown)

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


def external_hash(key: ChunkKey) -> bytes | int:
    """A chunk key in the form vLLM publishes block hashes (see the module's docstring), under vLLM's setting;
    the controller's fleet-wide stream gives the same (shared/wire/kv_events.py)."""
    return wire_events.external_hash(key, envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
