"""The simulated model: what each layer of a sim_kinds.py model writes for each token, and the oracle that computes
it from nothing. The simulated forward (sim_runner.py) and the oracle run the same `ModelMath`; they differ only in
where a step's inputs come from (the forward reads them from vLLM's paged caches, the oracle from its own
computation), so any page a load, a copy or a save got wrong makes the forward's values differ from the oracle's.

Like a transformer, per token t (the values of every tensor-parallel rank are computed together, as after an
all-reduce; digests are 8-byte blake2b):

  x_0(t)           = H(request extras, t, token t)                   the embedding
  attention layer  KV^r(t) = F(r, layer, x_in(t), d(t-1))            d(t-1): every rank's KV of this layer at t-1,
                   x_out(t) = H(x_in(t), d(t))                        read from the caches at the step's start
  state layer      S^r(t+1) = G(r, layer, x_in(t), S^r(t))           S(start): every rank's page that vLLM's
                   x_out(t) = H(x_in(t), S^*(t+1))                    forward starts from; S(0) is zeros
  draft layer      KV^r(t) = F(r, layer, x_top(t), d(t-1))           EAGLE: reads the target's last hidden state

So a layer's KV at t depends on every lower layer at t and, through them and its own d(t-1), on everything before
t: one wrong block or state makes every later value of the layers above it wrong. MLA's latent is the same on
every rank (vLLM does not shard it). Not modelled: EAGLE's one-token shift (the draft layer's KV at t also depends
on token t + 1); vLLM itself reuses a prefix's last draft position computed for another continuation, which only
steers proposals the target verifies.

Values: an attention token is [heads, 2, head_size] bf16 bits (integers -64..63, exact in bf16), an MLA token
[MLA_DIM] bf16 bits; a state S is an 8-byte seed whose page holds the seed then bytes expanded from it
(`state_page`), so a page read back names the state it holds, or is recognisably garbage.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from support.engine import HEAD_SIZE, HEADS
from support.sim_kinds import DRAFT, MLA, MLA_DIM, STATE_ROLES, GroupKind

_LUT = torch.arange(-64, 64, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy().copy()
_START = b"\0" * 8  # the digest before a sequence's first token
ZERO_STATE = b"\0" * 8  # the state before any token (vLLM starts a request with no initial state from zeros)


def _h(*parts: object) -> bytes:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part if isinstance(part, bytes) else str(part).encode())
        digest.update(b"|")
    return digest.digest()


def _bits(seed: bytes, count: int) -> np.ndarray:
    """`count` bf16 bit patterns (int16) drawn from `seed`."""
    mult = (np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    ints = ((mult * np.uint64(int.from_bytes(seed, "little"))) >> np.uint64(57)).astype(np.int64)
    return _LUT[ints]


def digest(values: np.ndarray | bytes) -> bytes:
    return hashlib.blake2b(values if isinstance(values, bytes) else values.tobytes(), digest_size=8).digest()


def joint_digest(ranks: Sequence[np.ndarray]) -> bytes:
    """d of one token: its KV on every rank, in rank order (what tensor parallelism's all-reduce mixes)."""
    return digest(b"".join(digest(value) for value in ranks))


def state_page(seed: bytes, nbytes: int) -> np.ndarray:
    """The bytes of a state page holding state `seed`: the seed, then bytes expanded from it."""
    rest = np.frombuffer(hashlib.shake_128(seed).digest(nbytes - len(seed)), dtype=np.uint8)
    return np.concatenate([np.frombuffer(seed, dtype=np.uint8), rest])


def read_state(page: np.ndarray) -> bytes:
    """The state a page holds: its seed when the page is a state's, else a digest that names the garbage."""
    seed = page[:8].tobytes()
    if np.array_equal(page, state_page(seed, len(page))):
        return seed
    return b"?" + digest(page.tobytes())[:7]


@dataclass(frozen=True)
class LayerOut:
    """One layer's values for a span of tokens: `values[r][i]` (attention: token bits; state: the seed after the
    token) and, for attention, `digests[i]`: d of each token (what the next token's KV depends on)."""

    values: list[list[np.ndarray | bytes]]
    digests: list[bytes]


class ModelMath:
    """The simulated model of a kind, for `world_size` ranks."""

    def __init__(self, kind: GroupKind, world_size: int) -> None:
        self.kind = kind
        self.world_size = world_size
        self.layers = kind.layers
        self._memo: dict[tuple[object, ...], tuple[list[object], bytes, bytes]] = {}

    def embed(self, tag: str, start: int, tokens: Sequence[int]) -> list[bytes]:
        """x_0 of tokens [start, start + len(tokens))."""
        return [_h("x", tag, start + i, token) for i, token in enumerate(tokens)]

    def token_value(self, rank: int, index: int, x: bytes, prev: bytes) -> np.ndarray:
        role = self.layers[index].role
        seed = _h("kv", 0 if role == MLA else rank, index, x, prev)
        if role == MLA:
            return _bits(seed, MLA_DIM)
        return _bits(seed, HEADS * 2 * HEAD_SIZE).reshape(HEADS, 2, HEAD_SIZE)

    def attention(self, index: int, xs: Sequence[bytes], prev: bytes) -> tuple[LayerOut, list[bytes]]:
        """Attention (or draft) layer `index` over tokens whose inputs are `xs`, after KV digest `prev`; and the
        hidden states it passes on."""
        values: list[list[np.ndarray | bytes]] = [[] for _ in range(self.world_size)]
        digests, out = [], []
        for x in xs:
            key = ("a", index, x, prev)
            hit = self._memo.get(key)
            if hit is None:
                ranks = [self.token_value(r, index, x, prev) for r in range(self.world_size)]
                joint = joint_digest(ranks)
                hit = self._memo[key] = (ranks, joint, _h(x, joint))
            for r, value in enumerate(hit[0]):
                values[r].append(value)  # type: ignore[arg-type]
            prev = hit[1]
            digests.append(prev)
            out.append(hit[2])
        return LayerOut(values, digests), out

    def state(self, index: int, xs: Sequence[bytes], states: Sequence[bytes]) -> tuple[LayerOut, list[bytes]]:
        """State layer `index` over tokens whose inputs are `xs`, from every rank's state `states`."""
        values: list[list[np.ndarray | bytes]] = [[] for _ in range(self.world_size)]
        current = list(states)
        out = []
        for x in xs:
            key = ("s", index, x, tuple(current))
            hit = self._memo.get(key)
            if hit is None:
                nxt = [_h("state", r, index, x, current[r]) for r in range(self.world_size)]
                hit = self._memo[key] = (nxt, b"", _h(x, b"".join(nxt)))
            current = list(hit[0])  # type: ignore[arg-type]
            for r, seed in enumerate(current):
                values[r].append(seed)
            out.append(hit[2])
        return LayerOut(values, []), out

    def forget(self) -> None:
        if len(self._memo) > 1_000_000:
            self._memo.clear()


@dataclass(frozen=True)
class Expected:
    """What a sequence's layers hold after every token, from nothing: `layers[i][r]` is a list over tokens
    (attention: token bits; state: the seed after the token)."""

    layers: list[list[list[np.ndarray | bytes]]]

    def state_after(self, index: int, rank: int, num_tokens: int) -> bytes:
        return ZERO_STATE if num_tokens == 0 else self.layers[index][rank][num_tokens - 1]  # type: ignore[return-value]


class Oracle:
    """Every layer's values of a sequence computed from nothing (memoized per sequence and per token)."""

    def __init__(self, math: ModelMath) -> None:
        self.math = math
        self._seqs: dict[tuple[str, tuple[int, ...]], Expected] = {}

    def expected(self, tag: str, tokens: Sequence[int]) -> Expected:
        key = (tag, tuple(tokens))
        got = self._seqs.get(key)
        if got is not None:
            return got
        math = self.math
        xs = math.embed(tag, 0, tokens)
        top = xs
        layers: list[list[list[np.ndarray | bytes]]] = []
        for index, layer in enumerate(math.layers):
            if layer.role in STATE_ROLES:
                out, xs = math.state(index, xs, [ZERO_STATE] * math.world_size)
            elif layer.role == DRAFT:
                out, _ = math.attention(index, top, _START)
            else:
                out, xs = math.attention(index, xs, _START)
            if layer.role != DRAFT:
                top = xs
            layers.append(out.values)
        if len(self._seqs) > 2048:
            self._seqs.clear()
            math.forget()
        got = self._seqs[key] = Expected(layers)
        return got

    def find_state(self, index: int, rank: int, seed: bytes) -> tuple[str, int, int] | None:
        """Which sequence seen so far holds state `seed` in layer `index` on `rank` after how many tokens:
        (tag, its length, tokens) or None (to name the state a wrong page holds)."""
        for (tag, tokens), expected in self._seqs.items():
            for n in range(len(tokens) + 1):
                if expected.state_after(index, rank, n) == seed:
                    return tag, len(tokens), n
        return None


__all__ = ["Expected", "LayerOut", "ModelMath", "Oracle", "ZERO_STATE", "digest", "joint_digest", "read_state",
           "state_page"]
