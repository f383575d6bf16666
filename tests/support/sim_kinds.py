"""The kinds of KV cache groups the seeded simulation builds: one small model per kind, described the way vLLM
learns a model's KV cache (one `KVCacheSpec` per layer, what `get_kv_cache_spec` of each layer returns).

vLLM itself groups the layers, sizes and shares their pages (sim_vllm.py calls its `get_kv_cache_configs`). Every
kind has 16-token blocks (support.engine.BLOCK) and KVMesh chunks of 32 tokens (CHUNK):

  full         two full-attention layers: one group.
  sliding      full, sliding window (24 tokens), full, sliding: a full and a sliding-window group.
  mamba2       full, Mamba2, full, Mamba2 in vLLM's "align" mode (prefix caching): a full group and a state group
               (one prefill checkpoint block, as vLLM's MambaMixer2 declares it); hash block = Mamba block.
  mamba2-fine  the same with --prefix-match-unit 8: vLLM's fine-grained partial hash hits (hash block 8 < Mamba
               block 16), its default when a hybrid model's unified block is larger than the hash block.
  gdn          full, Gated DeltaNet, full, GDN ("align" mode; GDN declares no prefill checkpoint block).
  gdn-fine     the same with hash block 8.

The hybrid models start with an attention layer. vLLM pairs each state layer's pages with an attention layer's (one
buffer, the same bytes), and its copy-on-write of blocks (`copy_kv_cache_blocks_inplace`, fine-grained partial hits)
copies each shared page once, through the first layer's view that starts there; a state layer's view covers only the
state's bytes, fewer than the page, so with a state layer first vLLM copies part of an attention block (a vLLM
0.32 issue the simulation found, outside KVMesh).
  eagle        two full-attention layers and an EAGLE draft layer (2 speculative tokens a step): one group.
  mla          two MLA layers (one latent vector a token, no K/V halves): one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from support.engine import BLOCK, CHUNK, HEAD_SIZE, HEADS

# what a layer is, to vLLM and to the simulated forward
ATTENTION, SLIDING, MLA, DRAFT, MAMBA2, GDN = "attention", "sliding", "mla", "draft", "mamba2", "gdn"
STATE_ROLES = (MAMBA2, GDN)
SLIDING_WINDOW = 24  # not a multiple of the block: the window's first block is partly outside it
FINE_HASH_BLOCK = BLOCK // 2
MLA_DIM = 64  # latent + rope dims of one token (bf16)
SPEC_TOKENS = 2
# recurrent state per layer: (shapes, dtypes) of its conv and SSM states, padded by vLLM to an attention page
STATE_SHAPES = {MAMBA2: (((3, 64), (4, 8, 16)), (torch.bfloat16, torch.float32)),
                GDN: (((3, 96), (2, 16, 16)), (torch.bfloat16, torch.float32))}


@dataclass(frozen=True)
class ModelLayer:
    name: str  # the layer's name in vLLM (its KV cache's key)
    role: str  # ATTENTION, SLIDING, MLA, DRAFT, MAMBA2 or GDN

    @property
    def has_state(self) -> bool:
        return self.role in STATE_ROLES


@dataclass(frozen=True)
class GroupKind:
    name: str
    layers: tuple[ModelLayer, ...]  # model order; the draft layer last
    hash_block_size: int | None = None  # vLLM's --prefix-match-unit (None: its default)
    spec_tokens: int = 0  # EAGLE's speculative tokens per step

    @property
    def has_state(self) -> bool:
        return any(layer.has_state for layer in self.layers)

    @property
    def single_group(self) -> bool:
        """One full-attention group: KVMesh copies without per-group tables (and can load layer by layer)."""
        return all(layer.role in (ATTENTION, DRAFT, MLA) for layer in self.layers)

    def specs(self) -> dict[str, object]:
        """Each layer's KVCacheSpec, as the model's layers declare them."""
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

        def spec(layer: ModelLayer) -> object:
            if layer.role in (ATTENTION, DRAFT):
                return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                         dtype=torch.bfloat16)
            if layer.role == SLIDING:
                return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                         dtype=torch.bfloat16, sliding_window=SLIDING_WINDOW)
            if layer.role == MLA:
                return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_DIM, dtype=torch.bfloat16,
                                        cache_dtype_str="auto")
            shapes, dtypes = STATE_SHAPES[layer.role]
            if layer.role == MAMBA2:  # MambaMixer2.get_kv_cache_spec: its backend exports a prefill checkpoint
                return MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align",
                                 mamba_type=MambaAttentionBackendEnum.MAMBA2, num_prefill_checkpoint_blocks=1,
                                 prefill_checkpoint_alignment=1)
            return MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align",
                             mamba_type=MambaAttentionBackendEnum.GDN_ATTN)

        return {layer.name: spec(layer) for layer in self.layers}


def _layers(*roles: str) -> tuple[ModelLayer, ...]:
    names = {ATTENTION: "self_attn", SLIDING: "self_attn", MLA: "self_attn", DRAFT: "self_attn",
             MAMBA2: "mixer", GDN: "linear_attn"}
    return tuple(ModelLayer(f"model.layers.{i}.{names[role]}", role) for i, role in enumerate(roles))


KINDS: dict[str, GroupKind] = {kind.name: kind for kind in (
    GroupKind("full", _layers(ATTENTION, ATTENTION)),
    GroupKind("sliding", _layers(ATTENTION, SLIDING, ATTENTION, SLIDING)),
    GroupKind("mamba2", _layers(ATTENTION, MAMBA2, ATTENTION, MAMBA2)),
    GroupKind("mamba2-fine", _layers(ATTENTION, MAMBA2, ATTENTION, MAMBA2), hash_block_size=FINE_HASH_BLOCK),
    GroupKind("gdn", _layers(ATTENTION, GDN, ATTENTION, GDN)),
    GroupKind("gdn-fine", _layers(ATTENTION, GDN, ATTENTION, GDN), hash_block_size=FINE_HASH_BLOCK),
    GroupKind("eagle", _layers(ATTENTION, ATTENTION, DRAFT), spec_tokens=SPEC_TOKENS),
    GroupKind("mla", _layers(MLA, MLA)),
)}

__all__ = ["ATTENTION", "CHUNK", "DRAFT", "GDN", "GroupKind", "KINDS", "MAMBA2", "MLA", "ModelLayer", "SLIDING",
           "SLIDING_WINDOW", "STATE_ROLES"]
