"""Benchmark of the paged KV copies (services/engine/core/paged_copy.py): store (gather) and retrieve (scatter).

Llama-3.1-8B-shaped KV (32 layers, 8 KV heads, head size 128, bf16), 8k tokens, chunks of 256 tokens,
blocks in a shuffled order (a request's blocks are rarely consecutive). Each figure is next to a plain
torch copy (``dst.copy_(src)``) of the same bytes in the same chunk sizes, in the same run, as a ratio.

  --device cpu  (default): vLLM's CPU layout (LBHNC, block 128, per-block copies), torch path, for each
                 ``--threads`` value (torch.set_num_threads).
  --device cuda: the CuPy kernels (per-token layouts, block 16): gather GPU -> pinned host, scatter pinned
                 host -> GPU, and device -> device both ways; next to ``copy_`` D2H / H2D / D2D of the
                 same bytes. Needs only torch, numpy and cupy (no vLLM).

  --tune (with cuda): also sweep the kernels' launch shape and print the host cost of one call.
  --chunk-size N: chunks of N tokens (default 256). At 256 tokens a D2D chunk (32 MB) takes ~28 us on an
                 H100, about the Python/CuPy cost of one launch, so D2D figures there also measure the host;
                 1024-token chunks show the kernels' own speed.

Prints one JSON object per line. Example: ``python benchmarks/engine_copy.py --device cpu --threads 1,2``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _import_engine() -> types.SimpleNamespace:
    """The engine modules; without an installed kvmesh (e.g. a bare GPU box) map the package onto the repo."""
    try:
        from kvmesh.services.engine.core import kv_layout, paged_copy, paged_kernels, paged_torch
    except ImportError:
        for name, path in (
            ("kvmesh", ROOT / "kvmesh_pkg"),
            ("kvmesh.services", ROOT / "services"),
            ("kvmesh.services.engine", ROOT / "services" / "engine"),
        ):
            if name not in sys.modules:  # a bare package: no __init__ runs, nothing else gets imported
                module = types.ModuleType(name)
                module.__path__ = [str(path)]
                sys.modules[name] = module
        from kvmesh.services.engine.core import kv_layout, paged_copy, paged_kernels, paged_torch
    return types.SimpleNamespace(kv_layout=kv_layout, paged_copy=paged_copy, paged_kernels=paged_kernels,
                                 paged_torch=paged_torch)


ENGINE = _import_engine()
KVLayout = ENGINE.kv_layout.KVLayout

LAYERS, KV_HEADS, HEAD_SIZE, DTYPE = 32, 8, 128, torch.bfloat16


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def chunk_slot_mappings(
    block_table: list[int], block_size: int, num_tokens: int, chunk: int, device: torch.device
) -> list[torch.Tensor]:
    slots = torch.tensor(block_table, dtype=torch.int64).repeat_interleave(block_size) * block_size
    slots = slots + torch.arange(slots.numel()) % block_size
    slots = slots[:num_tokens]
    return [slots[i : i + chunk].to(device) for i in range(0, num_tokens, chunk)]


# --------------------------------------------------------------------------------------------------
# CPU: vLLM's CPU layout, per-block copies, torch path
# --------------------------------------------------------------------------------------------------


def bench_cpu(args: argparse.Namespace) -> None:
    bs, chunk, tokens = args.cpu_block_size, args.chunk_size, args.tokens
    nb = tokens // bs + 8
    # Like vLLM's allocate_kv_cache for CPU_ATTN (LBHNC): one buffer, layer l = [nb, H, N, 2D] at l * nb * page.
    buf = torch.randn(LAYERS, nb, KV_HEADS, bs, 2 * HEAD_SIZE).to(DTYPE)
    caches = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}
    layout = ENGINE.kv_layout.detect_layout(caches, bs, "CPU_ATTN", cpu_isa="vec")  # vec: ISA of bf16/b128 w/o AMX
    layout.check_chunk_size(chunk)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(nb, generator=gen)[: -(-tokens // bs)].tolist()
    mappings = chunk_slot_mappings(table, bs, tokens, chunk, torch.device("cpu"))
    outs = [torch.empty(layout.chunk_shape(m.numel()), dtype=DTYPE) for m in mappings]  # the store's pool
    plain_src = [torch.empty_like(o).fill_(1) for o in outs]
    copier = ENGINE.paged_copy.PagedCopier(layout, "cpu")
    nbytes = sum(o.numel() * o.element_size() for o in outs)

    # correctness once: store, retrieve into a zeroed cache, the used blocks come back identical
    for m, o in zip(mappings, outs):
        copier.gather(caches, m, o)
    fresh = torch.zeros_like(buf)
    fresh_caches = [fresh[i] for i in range(LAYERS)]
    for m, o in zip(mappings, outs):
        copier.scatter(o, fresh_caches, m)
    assert torch.equal(fresh[:, table].view(torch.int16), buf[:, table].view(torch.int16)), "round trip differs"

    def store() -> None:
        for m, o in zip(mappings, outs):
            copier.gather(caches, m, o)

    def retrieve() -> None:
        for m, o in zip(mappings, outs):
            copier.scatter(o, caches, m)

    def plain() -> None:
        for s, o in zip(plain_src, outs):
            o.copy_(s)

    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {"torch_copy": [], "store": [], "retrieve": []}
        fns: dict[str, Callable[[], None]] = {"torch_copy": plain, "store": store, "retrieve": retrieve}
        for fn in fns.values():  # warm-up
            fn()
        for _ in range(args.repeats):  # interleaved, so drifts hit all three alike
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = nbytes / statistics.median(times["torch_copy"]) / 1e9
        for name in fns:
            gbps = nbytes / statistics.median(times[name]) / 1e9
            emit(
                bench="engine_copy",
                device="cpu",
                layout=layout.chunk_format(),
                op=name,
                threads=threads,
                tokens=tokens,
                chunk_size=chunk,
                block_size=bs,
                bytes=nbytes,
                GBps=round(gbps, 2),
                best_GBps=round(nbytes / min(times[name]) / 1e9, 2),
                ratio_vs_torch_copy=round(gbps / base, 3),
            )


# --------------------------------------------------------------------------------------------------
# CUDA: the CuPy kernels
# --------------------------------------------------------------------------------------------------


def gpu_caches(kind: str, nb: int, bs: int, device: torch.device) -> dict[str, torch.Tensor]:
    if kind == "NHD-2x":  # vLLM 0.10-0.2x flash-attn: [2, nb, bs, H, D] per layer
        buf = torch.randn(LAYERS, 2, nb, bs, KV_HEADS, HEAD_SIZE, device=device).to(DTYPE)
        return {f"l{i}": buf[i] for i in range(LAYERS)}
    # vLLM >= 0.3x: one buffer, layer view [nb, H, N, 2D] with LBNHC strides (physical [L, nb, N, H, 2D])
    buf = torch.randn(LAYERS, nb, bs, KV_HEADS, 2 * HEAD_SIZE, device=device).to(DTYPE)
    return {f"l{i}": buf[i].transpose(1, 2) for i in range(LAYERS)}


def bench_cuda(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        emit(bench="engine_copy", device="cuda", skipped="CUDA not available")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    bs, chunk, tokens = args.gpu_block_size, args.chunk_size, args.tokens
    nb = tokens // bs + 64
    for kind, hint in (("BHNC-LBNHC", "FLASH_ATTN"), ("NHD-2x", "FLASH_ATTN")):
        caches = gpu_caches(kind, nb, bs, device)
        layout = ENGINE.kv_layout.detect_layout(caches, bs, hint)
        gen = torch.Generator().manual_seed(0)
        table = torch.randperm(nb, generator=gen)[: -(-tokens // bs)].tolist()
        mappings = chunk_slot_mappings(table, bs, tokens, chunk, device)
        copier = ENGINE.paged_copy.PagedCopier(layout, device)
        shapes = [layout.chunk_shape(m.numel()) for m in mappings]
        host = [torch.empty(s, dtype=DTYPE).pin_memory() for s in shapes]
        dev = [torch.empty(s, dtype=DTYPE, device=device) for s in shapes]
        dev_src = [torch.empty(s, dtype=DTYPE, device=device).fill_(1) for s in shapes]
        nbytes = sum(h.numel() * h.element_size() for h in host)

        # correctness once, against the torch path (the oracle)
        ref = torch.empty(shapes[0], dtype=DTYPE, device=device)
        ENGINE.paged_torch.gather(list(caches.values()), layout, mappings[0], ref)
        copier.gather(caches, mappings[0], host[0])
        copier.gather(caches, mappings[0], dev[0])
        torch.cuda.synchronize()
        pinned_ok = torch.equal(host[0].to(device).view(torch.int16), ref.view(torch.int16))
        assert pinned_ok, "kernel gather (pinned) differs"
        assert torch.equal(dev[0].view(torch.int16), ref.view(torch.int16)), "kernel gather (device) differs"

        def loop(fn: Callable[[int], None]) -> Callable[[], None]:
            return lambda: [fn(i) for i in range(len(mappings))]

        staging = {s: torch.empty(s, dtype=DTYPE, device=device) for s in set(shapes)}

        def staged_gather(i: int) -> None:  # kernel into a device buffer, then one DMA copy to pinned host
            copier.gather(caches, mappings[i], staging[shapes[i]])
            host[i].copy_(staging[shapes[i]], non_blocking=True)

        def staged_scatter(i: int) -> None:  # one DMA copy from pinned host, then the kernel
            staging[shapes[i]].copy_(host[i], non_blocking=True)
            copier.scatter(staging[shapes[i]], caches, mappings[i])

        ops: dict[str, tuple[Callable[[], None], str]] = {
            "copy_D2H": (loop(lambda i: host[i].copy_(dev_src[i], non_blocking=True)), "copy_D2H"),
            "gather_D2H": (loop(lambda i: copier.gather(caches, mappings[i], host[i])), "copy_D2H"),
            "gather_D2H_staged": (loop(staged_gather), "copy_D2H"),
            "copy_H2D": (loop(lambda i: dev[i].copy_(host[i], non_blocking=True)), "copy_H2D"),
            "scatter_H2D": (loop(lambda i: copier.scatter(host[i], caches, mappings[i])), "copy_H2D"),
            "scatter_H2D_staged": (loop(staged_scatter), "copy_H2D"),
            "copy_D2D": (loop(lambda i: dev[i].copy_(dev_src[i])), "copy_D2D"),
            "gather_D2D": (loop(lambda i: copier.gather(caches, mappings[i], dev[i])), "copy_D2D"),
            "scatter_D2D": (loop(lambda i: copier.scatter(dev[i], caches, mappings[i])), "copy_D2D"),
            "torch_gather_D2D": (
                loop(lambda i: ENGINE.paged_torch.gather(list(caches.values()), layout, mappings[i], dev[i])),
                "copy_D2D",
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in ops}
        for fn, _ in ops.values():
            fn()
        torch.cuda.synchronize()
        for _ in range(args.repeats):
            for name, (fn, _) in ops.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
        gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
        for name, (_, baseline) in ops.items():
            emit(
                bench="engine_copy",
                device=torch.cuda.get_device_name(device),
                layout=kind,
                op=name,
                tokens=tokens,
                chunk_size=chunk,
                block_size=bs,
                bytes=nbytes,
                GBps=round(gbps[name], 2),
                baseline=baseline,
                ratio_vs_baseline=round(gbps[name] / gbps[baseline], 3),
                kernels=copier.backend,
            )
        del caches, host, dev, dev_src
        torch.cuda.empty_cache()


def tune_cuda(args: argparse.Namespace) -> None:
    """Sweep the kernels' launch shape (threads per CTA x token rounds) on the vLLM >= 0.3x layout."""
    device = torch.device("cuda", torch.cuda.current_device())
    bs, chunk, tokens = args.gpu_block_size, args.chunk_size, args.tokens
    nb = tokens // bs + 64
    caches = gpu_caches("BHNC-LBNHC", nb, bs, device)
    layout = ENGINE.kv_layout.detect_layout(caches, bs, "FLASH_ATTN")
    table = torch.randperm(nb, generator=torch.Generator().manual_seed(0))[: -(-tokens // bs)].tolist()
    mappings = chunk_slot_mappings(table, bs, tokens, chunk, device)
    copier = ENGINE.paged_copy.PagedCopier(layout, device)
    shapes = [layout.chunk_shape(m.numel()) for m in mappings]
    host = [torch.empty(s, dtype=DTYPE).pin_memory() for s in shapes]
    dev = [torch.empty(s, dtype=DTYPE, device=device) for s in shapes]
    nbytes = sum(h.numel() * h.element_size() for h in host)
    pc = ENGINE.paged_kernels  # the launch shape knobs
    for threads in (128, 256, 512):
        for rounds in (1, 2, 4, 8):
            pc.THREADS_PER_CTA, pc.TOKEN_ROUNDS = threads, rounds
            row: dict[str, float] = {}
            for name, dst in (("gather_D2D", dev), ("gather_D2H", host)):
                for direction in ("gather", "scatter"):
                    def run() -> None:
                        for i, m in enumerate(mappings):
                            if direction == "gather":
                                copier.gather(caches, m, dst[i])
                            else:
                                copier.scatter(dst[i], caches, m)
                    run()
                    times = []
                    for _ in range(args.repeats):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        run()
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end) / 1e3)
                    host_key = "gather_D2H" if direction == "gather" else "scatter_H2D"
                    key = f"{direction}_D2D" if dst is dev else host_key
                    row[key] = round(nbytes / statistics.median(times) / 1e9, 1)
            emit(bench="engine_copy_tune", threads=threads, token_rounds=rounds, **row)
    pc.THREADS_PER_CTA, pc.TOKEN_ROUNDS = 256, 2
    # host-side cost of one call (1-token chunks: the GPU work is negligible)
    one = [m[:1] for m in mappings]
    tiny = torch.empty(layout.chunk_shape(1), dtype=DTYPE, device=device)
    for name, fn in (
        ("gather", lambda m: copier.gather(caches, m, tiny)),
        ("scatter", lambda m: copier.scatter(tiny, caches, m)),
        ("torch_gather", lambda m: ENGINE.paged_torch.gather(list(caches.values()), layout, m, tiny)),
    ):
        fn(one[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            for m in one:
                fn(m)
        host_us = (time.perf_counter() - t0) / (50 * len(one)) * 1e6
        torch.cuda.synchronize()
        emit(bench="engine_copy_call_overhead", op=name, host_us_per_call=round(host_us, 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="cpu")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch.set_num_threads values (CPU)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--cpu-block-size", type=int, default=128)
    parser.add_argument("--gpu-block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tune", action="store_true", help="CUDA: sweep the kernels' launch shape")
    args = parser.parse_args(argv)
    args.threads = [int(t) for t in str(args.threads).split(",") if t]
    if args.device in ("cpu", "all"):
        bench_cpu(args)
    if args.device in ("cuda", "all"):
        if args.tune:
            tune_cuda(args)
        bench_cuda(args)


if __name__ == "__main__":
    main()
