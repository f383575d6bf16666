"""Chunk keys: a token sequence cut into chunks of `chunk_size` tokens, each named by a prefix hash.

key[i] = blake2b-128(key[i-1] || tokens of chunk i as little-endian int64), and key[-1] is the digest of the
instance's `KeyParams` (model, KV format, world size, rank). The result depends only on those inputs: no
Python `hash()`, no PYTHONHASHSEED, so every process on every host names the same chunk the same way.
Keys are 16 raw bytes (`ChunkKey`); `key.hex()` is their name in files and logs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

ChunkKey = bytes  # 16 bytes
KEY_BYTES = 16


@dataclass(frozen=True)
class KeyParams:
    """What makes two instances' chunks interchangeable: same model, same KV layout/dtype, same shard."""

    model: str
    kv_format: str  # dtype and layout tag, e.g. "bfloat16/LBHNC-128"
    world_size: int = 1
    rank: int = 0

    def root(self) -> ChunkKey:
        text = f"kvmesh/1|{self.model}|{self.kv_format}|{self.world_size}|{self.rank}"
        return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


@dataclass(frozen=True)
class ChunkSpan:
    """Chunk `index` covers tokens [start, end) and is named `key`."""

    index: int
    start: int
    end: int
    key: ChunkKey

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def tokens_as_array(tokens: Sequence[int] | np.ndarray | "object") -> np.ndarray:
    """Tokens (list, numpy array or CPU torch tensor) as a contiguous little-endian int64 array."""
    if hasattr(tokens, "numpy"):  # torch tensor: no import of torch needed here
        tokens = tokens.detach().cpu().numpy()
    array = np.ascontiguousarray(np.asarray(tokens), dtype="<i8")
    if array.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {array.shape}")
    return array


def num_masked_prefix(mask: Sequence[bool] | np.ndarray | "object" | None, num_tokens: int, chunk_size: int) -> int:
    """How many leading tokens a seed-003 mask excludes (its leading False run).

    The mask must look like F..FT..T (False only as a prefix) and the False count must be a multiple of
    `chunk_size`; anything else is a ValueError, as seed 003 specifies.
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


class ChunkHasher:
    """Turns token sequences into chunk keys for one `KeyParams` and chunk size."""

    def __init__(self, params: KeyParams, chunk_size: int, save_unfull_chunk: bool = True) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.params = params
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self._root = params.root()

    def spans(self, tokens: Sequence[int] | np.ndarray | "object", mask: object = None) -> list[ChunkSpan]:
        """The chunks of `tokens` in order, skipping those a mask excludes.

        A partial last chunk is included only with `save_unfull_chunk`. Masked-out chunks still feed the
        prefix hash, so chunk i has the same key with or without a mask.
        """
        array = tokens_as_array(tokens)
        skip = num_masked_prefix(mask, len(array), self.chunk_size)
        return [span for span in self._iter_spans(array) if span.start >= skip]

    def keys(self, tokens: Sequence[int] | np.ndarray | "object") -> list[ChunkKey]:
        return [span.key for span in self.spans(tokens)]

    def _iter_spans(self, array: np.ndarray) -> Iterator[ChunkSpan]:
        data = memoryview(array).cast("B")
        limit = len(array) if self.save_unfull_chunk else len(array) - len(array) % self.chunk_size
        previous = self._root
        blake2b = hashlib.blake2b
        for index, start in enumerate(range(0, limit, self.chunk_size)):
            end = min(start + self.chunk_size, limit)
            digest = blake2b(previous, digest_size=KEY_BYTES)
            digest.update(data[start * 8 : end * 8])
            previous = digest.digest()
            yield ChunkSpan(index, start, end, previous)
