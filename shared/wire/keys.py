"""Chunk keys: a token sequence cut into chunks of `chunk_size` tokens, each named by a prefix hash.

chain[i] = blake2b-128(chain[i-1] || tokens of chunk i as little-endian int64), and chain[-1] is the digest of
the model and its KV format (`KeyParams.root`). A single-rank instance names chunk i `chain[i]`; rank r of a
tensor-parallel instance of world size w holds its own shard of every chunk and names it
blake2b-128(chain[i] || "w/r") under a personalisation of its own (`KeyParams.shard_key`), so the chain is
hashed once per request (by the scheduler) and every rank derives its keys from it for the cost of one tiny
hash per chunk. The result depends only on those inputs: no Python `hash()`, no PYTHONHASHSEED, so every
process on every host names the same chunk the same way. Keys are 16 raw bytes (`ChunkKey`); `key.hex()` is
their name in files and logs.

Token ids alone do not decide a chunk's KV. `KeyExtras` holds what else does, as vLLM's own block hashes
mix it in (`generate_block_hash_extra_keys` in vllm/v1/core/kv_cache_utils.py): the LoRA adapter (every
chunk), multimodal items whose placeholder tokens overlap the chunk (identifier, offset in the chunk,
length), `cache_salt` (first chunk) and prompt embeddings (a digest per chunk). A chunk with extras is
hashed as blake2b-128(key[i-1] || len(extras) || extras || tokens) under a personalisation of its own, so
it can never collide with a chunk without extras or with other extras; the chain carries every extra
forward. A request with no extras keeps exactly the plain keys.
"""

from __future__ import annotations

import array
import functools
import hashlib
import sys
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import msgpack
import numpy as np

ChunkKey = bytes  # 16 bytes
KEY_BYTES = 16
EXTRAS_PERSON = b"kvmesh-extras"  # blake2b personalisation of chunks hashed with extras
SHARD_PERSON = b"kvmesh-shard"  # blake2b personalisation of a rank's key derived from the chain key
STATE_PERSON = b"kvmesh-state"  # blake2b personalisation of a recurrent state's key (state_key)
STATE_GROUP_TAG = "M"  # a state group's letter in a chunk format's groups tag (".../gM1,M1,F1": kv_groups.py)
# What a stored object of a model with state groups is, named in its meta's fmt after the chunk format: a chunk (the
# attention groups' layers) or a state (the state groups' layers). A state and a one-block chunk have the same
# token count; objects of the layout before this split carry neither and are refused (KVLayout.object_format).
CHUNK_KIND = ";chunk"
STATE_KIND = ";state"


@dataclass(frozen=True)
class KeyParams:
    """What makes two instances' chunks interchangeable: same model, same KV layout/dtype, same shard."""

    model: str
    kv_format: str  # dtype and layout tag, e.g. "bfloat16/LBHNC-128"
    world_size: int = 1
    rank: int = 0
    domain: str = "default"  # the engine's sharing domain (shared/messaging/credentials.py): two domains never share a key

    def root(self) -> ChunkKey:
        """The chain's root: the model and its KV format (the shard is applied per key, `shard_key`), and the
        sharing domain when it is not the default one (so default keys are the same bytes as before domains)."""
        text = f"kvmesh/1|{self.model}|{self.kv_format}|1|0"
        if has_state_groups(self.kv_format):
            # chunks hold the attention layers only, states the state layers only (KVLayout.object_layers): other
            # keys than the objects stored before, which held every layer (a store keeps the first object put
            # under a key, so an old one would shadow the new one; and old objects are never asked)
            text += "|objects=split"
        if self.domain != "default":
            text += f"|domain={self.domain}"
        return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()

    @property
    def sharded(self) -> bool:
        return (self.world_size, self.rank) != (1, 0)

    def shard_key(self, chain_key: ChunkKey) -> ChunkKey:
        """This shard's name for the chunk whose chain key is `chain_key` (the chain key itself for 1 of 1)."""
        if not self.sharded:
            return chain_key
        digest = hashlib.blake2b(chain_key, digest_size=KEY_BYTES, person=SHARD_PERSON)
        digest.update(f"{self.world_size}/{self.rank}".encode())
        return digest.digest()


@dataclass(frozen=True)
class KeyExtras:
    """What besides the token ids changes a request's KV. Empty for a plain text request.

    `lora_id`: the adapter's identity (a digest of its files, see services/engine/adapter/request_extras.py).
    `mm_identifiers` / `mm_offsets` / `mm_lengths`: one entry per multimodal item (vLLM's content hash of
    the item and its placeholder token range), sorted by offset. `embeds_digests[i]`: digest of the
    prompt embeddings of chunk i (chunk_size is the instance's). Also a wire type (`WorkerCommand.extras`):
    `check()` validates a decoded one.
    """

    lora_id: str | None = None
    cache_salt: str | None = None
    mm_identifiers: list[str] = field(default_factory=list)
    mm_offsets: list[int] = field(default_factory=list)
    mm_lengths: list[int] = field(default_factory=list)
    embeds_digests: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Raise ValueError naming what is inconsistent (lists of different lengths, negative ranges)."""
        if not len(self.mm_identifiers) == len(self.mm_offsets) == len(self.mm_lengths):
            raise ValueError(f"multimodal lists differ in length: {len(self.mm_identifiers)} identifiers, "
                             f"{len(self.mm_offsets)} offsets, {len(self.mm_lengths)} lengths")
        if any(o < 0 for o in self.mm_offsets) or any(n <= 0 for n in self.mm_lengths):
            raise ValueError("multimodal offsets must be >= 0 and lengths > 0")

    @property
    def empty(self) -> bool:
        return not (self.lora_id or self.cache_salt or self.mm_identifiers or self.embeds_digests)

    def chunk_items(self, start: int, end: int) -> list[tuple[str, int, int]]:
        """The multimodal items (identifier, offset, length) whose placeholders overlap tokens [start, end)."""
        return [(identifier, offset, length)
                for identifier, offset, length in zip(self.mm_identifiers, self.mm_offsets, self.mm_lengths)
                if offset < end and start < offset + length]

    def chunk_extras(self, index: int, start: int, end: int) -> bytes | None:
        """The extras that chunk `index` (tokens [start, end)) is hashed with, encoded; None if it has none."""
        parts: list[list[object]] = []
        if self.lora_id:
            parts.append(["lora", self.lora_id])
        for identifier, offset, length in self.chunk_items(start, end):
            parts.append(["mm", identifier, offset - start, length])
        if index == 0 and self.cache_salt:
            parts.append(["salt", self.cache_salt])
        if index < len(self.embeds_digests):
            parts.append(["embeds", self.embeds_digests[index]])
        return msgpack.packb(parts, use_bin_type=True) if parts else None


def state_key(chain_key: ChunkKey) -> ChunkKey:
    """The chain key of the recurrent state after the chunk whose chain key is `chain_key` (a model with Mamba /
    linear-attention layers stores it beside the chunk; sharded per rank like a chunk's)."""
    return hashlib.blake2b(chain_key, digest_size=len(chain_key), person=STATE_PERSON).digest()


@functools.lru_cache(maxsize=256)  # asked several times per chunk saved or loaded, of one engine's few formats
def state_groups(kv_format: str) -> tuple[bool, ...]:
    """Per KV cache group of `kv_format` (or of its groups tag alone), whether it holds recurrent state; () for a
    format without groups. The groups tag is the format's last part (KVLayout.chunk_format)."""
    tag = kv_format.rsplit("/", 1)[-1]
    if not tag.startswith("g"):
        return ()
    return tuple(group.startswith(STATE_GROUP_TAG) for group in tag[1:].split(","))


def has_state_groups(kv_format: str) -> bool:
    """Whether chunks of `kv_format` come with recurrent states: a prefix is usable only up to a chunk whose
    state is held too."""
    return any(state_groups(kv_format))


def is_state_object(fmt: str) -> bool:
    """Whether a stored object whose meta has this fmt is a recurrent state (else a chunk)."""
    return fmt.endswith(STATE_KIND)


@dataclass(frozen=True)
class ChunkSpan:
    """Chunk `index` covers tokens [start, end) and is named `key`; with `state`, the span is not that chunk but the
    recurrent state after it (`state_key`, stored on its own: KVLayout.object_layers)."""

    index: int
    start: int
    end: int
    key: ChunkKey
    state: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def tokens_as_array(tokens: Sequence[int] | np.ndarray | "object") -> np.ndarray:
    """Tokens (list, numpy array or CPU torch tensor) as a contiguous little-endian int64 array."""
    if hasattr(tokens, "numpy"):  # torch tensor: no import of torch needed here
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, list):  # a list of ints: array.array packs it ~2x faster than np.asarray
        packed = array.array("q", tokens)
        if sys.byteorder != "little":
            packed.byteswap()
        return np.frombuffer(packed, dtype="<i8")
    values = np.ascontiguousarray(np.asarray(tokens), dtype="<i8")
    if values.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {values.shape}")
    return values


def num_masked_prefix(mask: Sequence[bool] | np.ndarray | "object" | None, num_tokens: int, chunk_size: int) -> int:
    """How many leading tokens a cache-engine mask excludes (its leading False run).

    The mask must look like F..FT..T (False only as a prefix) and the False count must be a multiple of
    `chunk_size`; anything else is a ValueError, as the cache engine API specifies (docs/compatibility.md).
    """
    if mask is None:
        return 0
    if hasattr(mask, "numpy"):
        mask = mask.detach().cpu().numpy()
    flags = np.asarray(mask, dtype=bool)
    if flags.shape != (num_tokens,):
        raise ValueError(f"mask has shape {flags.shape}, expected ({num_tokens},) to match the tokens")
    num_false = int(np.argmax(flags)) if flags.any() else num_tokens
    if not flags[num_false:].all():
        raise ValueError("mask must be False only as a prefix (F...FT...T)")
    if num_false % chunk_size != 0:
        raise ValueError(f"the number of False in the mask ({num_false}) must be a multiple of chunk_size ({chunk_size})")
    return num_false


def chunk_spans(chain_keys: Sequence[ChunkKey], num_tokens: int, chunk_size: int, first: int = 0) -> list[ChunkSpan]:
    """Spans of a sequence of `num_tokens` tokens whose chunks have these keys (chunk i = tokens [i*C, ...)), from
    chunk `first` on (a step's save: its cost does not grow with the chunks before it)."""
    return [ChunkSpan(i, i * chunk_size, min((i + 1) * chunk_size, num_tokens), chain_keys[i])
            for i in range(first, len(chain_keys))]


class ChunkHasher:
    """Turns token sequences into chunk keys for one `KeyParams` and chunk size.

    `chain()` gives the shard-independent chain (what the scheduler computes once per request); `spans()` the
    keys of this hasher's shard; `shard()` turns chain spans into this shard's spans.
    """

    def __init__(self, params: KeyParams, chunk_size: int, save_unfull_chunk: bool = True) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.params = params
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self._root = params.root()

    def spans(self, tokens: Sequence[int] | np.ndarray | "object", mask: object = None,
              extras: KeyExtras | None = None) -> list[ChunkSpan]:
        """This shard's chunks of `tokens` in order, skipping those a mask excludes.

        A partial last chunk is included only with `save_unfull_chunk`. Masked-out chunks still feed the
        prefix hash, so chunk i has the same key with or without a mask. `extras` (see `KeyExtras`) are
        mixed into the chunks they concern.
        """
        return self.shard(self.chain(tokens, mask, extras))

    def chain(self, tokens: Sequence[int] | np.ndarray | "object", mask: object = None,
              extras: KeyExtras | None = None, known: Sequence[ChunkSpan] = ()) -> list[ChunkSpan]:
        """The shard-independent chain spans of `tokens` (see `spans` for the mask and extras).

        `known`: chain spans already computed for a prefix of the same tokens and extras (a request that grew):
        its full chunks are reused, so only the new chunks are hashed.
        """
        array = tokens_as_array(tokens)
        skip = num_masked_prefix(mask, len(array), self.chunk_size)
        if extras is not None and extras.empty:
            extras = None
        reused = 0
        while (reused < len(known) and known[reused].num_tokens == self.chunk_size
               and known[reused].end <= len(array)):
            reused += 1
        spans = list(known[:reused]) + list(self._iter_spans(array, extras, reused,
                                                             known[reused - 1].key if reused else self._root))
        return [span for span in spans if span.start >= skip]

    def shard(self, chain_spans: Sequence[ChunkSpan]) -> list[ChunkSpan]:
        """This hasher's shard keys for chain spans (the same spans for a single-rank instance)."""
        params = self.params
        if not params.sharded:
            return list(chain_spans)
        return [ChunkSpan(s.index, s.start, s.end, params.shard_key(s.key), s.state) for s in chain_spans]

    def state_spans(self, chain_spans: Sequence[ChunkSpan], block_size: int) -> list[ChunkSpan]:
        """This shard's spans of the recurrent states after the full chunks of `chain_spans` (a state travels as
        one block's page, copied through the slots of the chunk's last block: KVGroups.state_slots)."""
        return self.shard([ChunkSpan(s.index, s.end - block_size, s.end, state_key(s.key), state=True)
                           for s in chain_spans if s.num_tokens == self.chunk_size])

    def spans_and_states(self, tokens: Sequence[int] | np.ndarray | "object", extras: KeyExtras | None,
                         state_block: int) -> tuple[list[ChunkSpan], list[ChunkSpan]]:
        """This shard's spans of `tokens` and, when `state_block` is set (KVLayout.state_block), of the states
        after their full chunks: what a pin, unpin or move of the tokens covers."""
        chain = self.chain(tokens, extras=extras)
        return self.shard(chain), self.state_spans(chain, state_block) if state_block else []

    def keys(self, tokens: Sequence[int] | np.ndarray | "object", extras: KeyExtras | None = None) -> list[ChunkKey]:
        return [span.key for span in self.spans(tokens, extras=extras)]

    def prefix_span(self, tokens: Sequence[int] | np.ndarray | "object", chain: Sequence[ChunkSpan], end: int,
                    extras: KeyExtras | None = None) -> ChunkSpan:
        """The span of tokens [i*C, end) of chunk i = (end - 1) // C: the key a sequence of `end` tokens names its
        partial last chunk with (a "block prefix" of the longer chunk i of `tokens`). `chain` holds the chain
        spans of `tokens` up to at least chunk i - 1 (its key is the prefix hash this one continues)."""
        index = (end - 1) // self.chunk_size
        if not 0 < end <= len(tokens) or len(chain) < index:
            raise ValueError(f"a prefix of {end} tokens needs {end} tokens and {index} chain spans, got "
                             f"{len(tokens)} and {len(chain)}")
        if extras is not None and extras.empty:
            extras = None
        previous = chain[index - 1].key if index else self._root
        start = index * self.chunk_size
        chunk = memoryview(tokens_as_array(tokens[start:end])).cast("B")  # only this chunk's tokens are packed
        return ChunkSpan(index, start, end, self._chunk_key(previous, index, start, end, chunk, extras))

    def _iter_spans(self, array: np.ndarray, extras: KeyExtras | None, first_index: int = 0,
                    previous: ChunkKey | None = None) -> Iterator[ChunkSpan]:
        data = memoryview(array).cast("B")
        limit = len(array) if self.save_unfull_chunk else len(array) - len(array) % self.chunk_size
        previous = previous if previous is not None else self._root
        for index, start in enumerate(range(first_index * self.chunk_size, limit, self.chunk_size), first_index):
            end = min(start + self.chunk_size, limit)
            previous = self._chunk_key(previous, index, start, end, data[start * 8 : end * 8], extras)
            yield ChunkSpan(index, start, end, previous)

    @staticmethod
    def _chunk_key(previous: ChunkKey, index: int, start: int, end: int, chunk: memoryview,
                   extras: KeyExtras | None) -> ChunkKey:
        """Chunk `index` (tokens [start, end), `chunk` their int64 little-endian bytes) after the chain key
        `previous`."""
        chunk_extras = extras.chunk_extras(index, start, end) if extras is not None else None
        if chunk_extras is None:
            digest = hashlib.blake2b(previous, digest_size=KEY_BYTES)
        else:
            digest = hashlib.blake2b(previous, digest_size=KEY_BYTES, person=EXTRAS_PERSON)
            digest.update(len(chunk_extras).to_bytes(4, "little"))
            digest.update(chunk_extras)
        digest.update(chunk)
        return digest.digest()
