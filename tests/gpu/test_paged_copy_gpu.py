"""The CuPy kernels of services/engine/core/paged_copy_kernels.cu against the torch path (the oracle).

Runs on a CUDA machine with CuPy (``python -m pytest tests/gpu -q``); skipped elsewhere. The torch path
itself is checked against naive per-token indexing on CPU in tests/engine/core/test_paged_copy.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from kvmesh.services.engine.core.kv_layout import KVLayout, detect_layout  # noqa: E402
from kvmesh.services.engine.core.paged_copy import PagedCopier  # noqa: E402
from kvmesh.services.engine.core.paged_torch import gather, scatter  # noqa: E402

DEVICE = torch.device("cuda", torch.cuda.current_device())
# uint8: the bytes of an fp8 KV cache (vLLM allocates fp8 caches as uint8)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

# physical shape, permutation to vLLM's logical shape, backend hint
KINDS = {
    "NHD-2x": (lambda nb, bs, h, d: (2, nb, bs, h, d), (0, 1, 2, 3, 4), "FLASH_ATTN"),
    "FI-NHD": (lambda nb, bs, h, d: (nb, 2, bs, h, d), (0, 1, 2, 3, 4), "FLASHINFER"),
    "FI-HND": (lambda nb, bs, h, d: (nb, 2, h, bs, d), (0, 1, 3, 2, 4), "FLASHINFER"),
    "BHNC-LBNHC": (lambda nb, bs, h, d: (nb, bs, h, 2 * d), (0, 2, 1, 3), "FLASH_ATTN"),
    "BHNC-LBHNC": (lambda nb, bs, h, d: (nb, h, bs, 2 * d), (0, 1, 2, 3), "FLASHINFER"),
    "MLA-3D": (lambda nb, bs, h, d: (nb, bs, d), (0, 1, 2), "FLASHMLA"),
    "MLA-BHNC": (lambda nb, bs, h, d: (nb, 1, bs, d), (0, 1, 2, 3), "FLASHMLA"),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()])


def make_caches(
    kind: str, layers: int, nb: int, bs: int, heads: int, d: int, dtype: torch.dtype, shared: bool
) -> list[torch.Tensor]:
    shape_fn, perm, _ = KINDS[kind]
    phys = shape_fn(nb, bs, heads, d)
    if shared:  # all layers in one buffer, like vLLM >= 0.3x
        buf = torch.randn((layers, *phys), device=DEVICE).to(dtype)
        return [buf[i].permute(*perm) for i in range(layers)]
    return [torch.randn(phys, device=DEVICE).to(dtype).permute(*perm) for _ in range(layers)]


def setup(
    kind: str, dtype: torch.dtype, bs: int, shared: bool, heads: int = 2, d: int = 64, layers: int = 3, nb: int = 12
) -> tuple[list[torch.Tensor], KVLayout, PagedCopier]:
    caches = make_caches(kind, layers, nb, bs, heads, d, dtype, shared)
    layout = detect_layout({str(i): c for i, c in enumerate(caches)}, bs, KINDS[kind][2])
    copier = PagedCopier(layout, DEVICE)
    assert copier.backend == "cupy"
    return caches, layout, copier


def slots_for(nb: int, bs: int, num_tokens: int, neg_every: int = 0) -> torch.Tensor:
    slots = torch.randperm(nb * bs)[:num_tokens].to(torch.int64)
    if neg_every:
        slots[::neg_every] = -1
    return slots.to(DEVICE)


def check_gather(
    caches: list[torch.Tensor], layout: KVLayout, copier: PagedCopier, slots: torch.Tensor
) -> torch.Tensor:
    shape = layout.chunk_shape(slots.numel())
    sentinel = torch.full(shape, 7.0, dtype=layout.dtype, device=DEVICE)
    ref = sentinel.clone()
    gather(caches, layout, slots, ref)  # torch path: the oracle
    dev = sentinel.clone()
    copier.gather(caches, slots, dev)
    pinned = sentinel.cpu().pin_memory()
    copier.gather(caches, slots, pinned)
    pageable = sentinel.cpu()
    copier.gather(caches, slots, pageable)
    torch.cuda.synchronize()
    assert torch.equal(bits(dev), bits(ref)), "device destination"
    assert torch.equal(bits(pinned.to(DEVICE)), bits(ref)), "pinned host destination"
    assert torch.equal(bits(pageable.to(DEVICE)), bits(ref)), "pageable host destination"
    return ref


def check_scatter(
    chunk: torch.Tensor,
    caches: list[torch.Tensor],
    layout: KVLayout,
    copier: PagedCopier,
    slots: torch.Tensor,
    skip: int,
) -> None:
    base = [torch.randn_like(c, dtype=torch.float32).to(c.dtype) for c in caches]
    for source in (chunk, chunk.cpu().pin_memory(), chunk.cpu()):  # device, pinned host, pageable host
        ref = [b.clone() for b in base]
        got = [b.clone() for b in base]
        scatter(chunk, ref, layout, slots, skip_prefix=skip)
        copier.scatter(source, got, slots, skip_prefix=skip)
        torch.cuda.synchronize()
        for r, g in zip(ref, got):
            assert torch.equal(bits(r), bits(g)), f"source on {source.device} pinned={source.is_pinned()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bs", [16, 17, 32, 64])
@pytest.mark.parametrize("shared", [True, False], ids=["one-buffer", "per-layer"])
def test_kernels_match_torch(dtype: torch.dtype, kind: str, bs: int, shared: bool) -> None:
    torch.manual_seed(hash((str(dtype), kind, bs, shared)) % 2**31)
    caches, layout, copier = setup(kind, dtype, bs, shared)
    nb = caches[0].shape[1] if kind == "NHD-2x" else caches[0].shape[0]
    for num_tokens, neg_every, skip in ((4 * bs, 0, 0), (2 * bs + 5, 0, bs + 3), (37, 4, 9), (1, 0, 0)):
        slots = slots_for(nb, bs, num_tokens, neg_every)
        chunk = check_gather(caches, layout, copier, slots)
        check_scatter(chunk, caches, layout, copier, slots, skip)


@pytest.mark.parametrize(
    "dtype,d", [(torch.float16, 4), (torch.float16, 3), (torch.float32, 3), (torch.bfloat16, 1), (torch.float32, 2)]
)
def test_narrow_vector_widths(dtype: torch.dtype, d: int) -> None:
    """Head bytes of 8, 6, 12, 2 and 8: the 8-, 2-, 4- and 2-byte kernels."""
    torch.manual_seed(d)
    caches, layout, copier = setup("NHD-2x", dtype, 16, True, heads=3, d=d)
    slots = slots_for(12, 16, 50, neg_every=7)
    chunk = check_gather(caches, layout, copier, slots)
    check_scatter(chunk, caches, layout, copier, slots, 11)


def test_unaligned_chunk_pointer() -> None:
    """A chunk starting 2 bytes into a buffer cannot use 16-byte vectors: still exact."""
    torch.manual_seed(5)
    caches, layout, copier = setup("BHNC-LBNHC", torch.float16, 16, True)
    slots = slots_for(12, 16, 40)
    shape = layout.chunk_shape(40)
    ref = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    gather(caches, layout, slots, ref)
    numel = ref.numel()
    buf = torch.zeros(numel + 1, dtype=torch.float16, device=DEVICE)
    out = buf[1:].view(shape)
    copier.gather(caches, slots, out)
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(ref))


def test_llama_shaped_chunk_and_current_stream() -> None:
    """32 layers x 8 heads x 128, bf16, 256 tokens, launched on a side stream."""
    torch.manual_seed(6)
    caches, layout, copier = setup("BHNC-LBNHC", torch.bfloat16, 16, True, heads=8, d=128, layers=32, nb=64)
    slots = slots_for(64, 16, 256)
    ref = torch.empty(layout.chunk_shape(256), dtype=torch.bfloat16, device=DEVICE)
    gather(caches, layout, slots, ref)
    out = torch.empty(layout.chunk_shape(256), dtype=torch.bfloat16).pin_memory()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copier.gather(caches, slots, out)
    side.synchronize()
    assert torch.equal(bits(out.to(DEVICE)), bits(ref))
    fresh = [torch.zeros_like(c) for c in caches]
    expected = [torch.zeros_like(c) for c in caches]
    scatter(ref, expected, layout, slots, skip_prefix=100)
    copier.scatter(out, fresh, slots, skip_prefix=100)
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(fresh, expected))


def test_torch_fallback_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_PAGED_COPY", "torch")
    caches = make_caches("NHD-2x", 2, 4, 16, 2, 8, torch.float16, True)
    layout = detect_layout({str(i): c for i, c in enumerate(caches)}, 16, "FLASH_ATTN")
    assert PagedCopier(layout, DEVICE).backend == "torch"


def test_an_nvrtc_failure_falls_back_to_torch_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvmesh.services.engine.core import paged_kernels

    broken = tmp_path / "broken.cu"
    broken.write_text('extern "C" __global__ void kvm_gather_v16( { this does not compile }\n')
    monkeypatch.setattr(paged_kernels, "KERNELS_FILE", broken)
    monkeypatch.setattr(paged_kernels.CupyKernels, "_by_device", {})
    caches = make_caches("NHD-2x", 2, 4, 16, 2, 8, torch.float16, True)
    layout = detect_layout({str(i): c for i, c in enumerate(caches)}, 16, "FLASH_ATTN")
    copier = PagedCopier(layout, DEVICE)
    assert copier.backend == "torch"  # the compile failed at construction of the kernels, not at a copy
    slots = torch.arange(20, device=DEVICE)
    out = torch.empty(layout.chunk_shape(20), dtype=torch.float16, device=DEVICE)
    copier.gather(caches, slots, out)  # the torch path does the copy
    expected = torch.empty_like(out)
    gather(caches, layout, slots, expected)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_a_gather_after_a_cuda_graph_replay_sees_what_the_replay_wrote() -> None:
    caches, layout, copier = setup("NHD-2x", torch.float16, 16, True)
    sources = [torch.randn_like(c) for c in caches]
    current = torch.cuda.current_stream()
    warmup = torch.cuda.Stream()
    warmup.wait_stream(current)
    with torch.cuda.stream(warmup):  # graphs are captured after a warm-up on a side stream
        for cache, source in zip(caches, sources):
            cache.copy_(source)
    current.wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for cache, source in zip(caches, sources):
            cache.copy_(source)
    for source in sources:
        source.fill_(3.0)  # only the replay writes these values into the caches
    torch.cuda._sleep(50_000_000)  # keep the stream busy: an unordered gather would read the old values
    graph.replay()
    slots = slots_for(12, 16, 40)
    out = torch.zeros(layout.chunk_shape(40), dtype=torch.float16).pin_memory()
    copier.gather(caches, slots, out)
    torch.cuda.synchronize()
    assert bool((out == 3.0).all())


def test_a_store_failing_mid_way_releases_its_slots_only_after_the_queued_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    pytest.importorskip("kvmesh.services.engine.core.cache_engine", reason="needs the full install")
    from kvmesh.services.engine.assembly import build_engine
    from kvmesh.services.engine.core import token_api
    from kvmesh.services.engine.tiers import memory_pool
    from kvmesh.shared.wire.keys import KeyParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the engine tests' helpers
    from support.engine import engine_config, random_tokens

    caches, layout, _ = setup("NHD-2x", torch.float16, 16, True, nb=64)
    engine = build_engine(engine_config(), KeyParams(model="gpu-test", kv_format=""), layout, use_mesh=False,
                          device=DEVICE)
    try:
        original, calls = engine.copier.gather, []

        def gather_then_fail(*args: object, **kwargs: object) -> None:
            calls.append(1)
            if len(calls) == 3:
                raise torch.cuda.OutOfMemoryError("injected: out of memory mid-store")
            original(*args, **kwargs)

        monkeypatch.setattr(engine.copier, "gather", gather_then_fail)
        stream_idle_at_release: list[bool] = []
        release = memory_pool.Slot.release
        monkeypatch.setattr(memory_pool.Slot, "release", lambda slot: (
            stream_idle_at_release.append(torch.cuda.current_stream().query()), release(slot)))
        torch.cuda._sleep(200_000_000)  # the forward still runs: the gathers queue behind it
        with pytest.raises(torch.cuda.OutOfMemoryError):
            token_api.store(engine, random_tokens(4 * 32, seed=7), kv_caches=caches,
                            slot_mapping=slots_for(64, 16, 4 * 32))
        assert stream_idle_at_release and all(stream_idle_at_release)
    finally:
        engine.close()


def test_kv_cache_groups_copy_each_group_through_its_own_slots_on_cuda() -> None:
    """vLLM's hybrid manager (adapter/kv_groups.py): layers in groups, one row of slots per group, -1 for a
    sliding window's freed blocks. The copier takes them on CUDA (group by group) as the CPU oracle does."""
    import dataclasses

    bs, nb, tokens = 16, 24, 64
    caches = make_caches("BHNC-LBNHC", 4, nb, bs, 2, 64, torch.bfloat16, True)
    layout = dataclasses.replace(detect_layout({str(i): c for i, c in enumerate(caches)}, bs, "FLASH_ATTN"),
                                 group_layers=(2, 2), groups_tag="gS2w32+0,F2")
    copier = PagedCopier(layout, DEVICE)
    window_blocks = torch.tensor([-1, -1, 5, 6], dtype=torch.int64)  # the window's blocks, the others freed
    full_blocks = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    offsets = torch.arange(bs, dtype=torch.int64)

    def row(blocks: torch.Tensor) -> torch.Tensor:
        slots = (blocks.unsqueeze(1) * bs + offsets).flatten()
        slots[(blocks < 0).repeat_interleave(bs)] = -1
        return slots

    slots = torch.stack([row(window_blocks), row(full_blocks)])
    sentinel = torch.full(layout.chunk_shape(tokens), 7.0, dtype=layout.dtype, device=DEVICE)
    ref = sentinel.cpu()
    gather([c.cpu() for c in caches], layout, slots, ref)  # the CPU oracle
    got = sentinel.clone()
    copier.gather(caches, slots.to(DEVICE), got)
    torch.cuda.synchronize()
    assert torch.equal(bits(got.cpu()), bits(ref))
    targets = [torch.zeros_like(c) for c in caches]
    copier.scatter(got, targets, slots.to(DEVICE))
    torch.cuda.synchronize()
    for i, (target, cache) in enumerate(zip(targets, caches)):
        blocks = window_blocks if i < 2 else full_blocks
        for b in blocks.tolist():
            if b >= 0:
                assert torch.equal(bits(target[b]), bits(cache[b])), (i, b)
        assert not target[0].any(), "a freed block (vLLM's null block 0) was written"
