"""The CuPy path of the paged copies (CUDA, per-token layouts): the kernels of `paged_copy_kernels.cu`, compiled
once per device with NVRTC, and their launches. CuPy is imported only when a CUDA tensor is seen (vLLM's CPU
build never imports it). The torch path (paged_torch.py) is their oracle.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from .kv_layout import KVLayout
from .paged_geometry import check_chunk

KERNELS_FILE = Path(__file__).with_name("paged_copy_kernels.cu")

__all__ = ["KERNELS_FILE", "THREADS_PER_CTA", "TOKEN_ROUNDS", "CupyKernels", "KernelLauncher"]

_VEC_WIDTHS = (16, 8, 4, 2, 1)
_MAX_TOKENS_PER_CTA = 64  # KVM_MAX_TOKENS_PER_CTA in the .cu (shared-memory table of token offsets)
_UNROLL = 4  # KVM_UNROLL in the .cu
# Launch shape knobs (module attributes so a benchmark can sweep them): threads per CTA, and how many
# rounds of UNROLL tokens each thread row copies (None: tuned default).
THREADS_PER_CTA = 256
TOKEN_ROUNDS = 2


def _launch_shape(
    per_token: int, num_tokens: int, num_layers: int
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, tokens_per_cta): x threads over one token's vectors, y over tokens, grid.y = layers."""
    x = min(THREADS_PER_CTA, -(-per_token // 32) * 32)
    y = max(1, THREADS_PER_CTA // x)
    tokens_per_cta = min(_MAX_TOKENS_PER_CTA, y * _UNROLL * TOKEN_ROUNDS)
    return (-(-num_tokens // tokens_per_cta), num_layers, 1), (x, y, 1), tokens_per_cta


class CupyKernels:
    """The compiled kernels of one CUDA device (CuPy's RawModule compiles with NVRTC, cached on disk)."""

    _lock = threading.Lock()
    _by_device: dict[int, CupyKernels] = {}

    def __init__(self, device_index: int) -> None:
        import cupy  # lazy: only when a CUDA tensor is seen

        self.cupy = cupy
        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            self.module = cupy.RawModule(code=KERNELS_FILE.read_text(), options=("--std=c++17",))
        self._functions: dict[str, Any] = {}
        # RawModule compiles lazily, at the first get_function: resolve every kernel now, so that an NVRTC
        # failure happens here, where the caller falls back to the torch path once, not at every copy.
        for vec in _VEC_WIDTHS:
            self.function(f"kvm_gather_v{vec}")
            self.function(f"kvm_scatter_v{vec}")
        self._streams: dict[int, Any] = {}

    @classmethod
    def get(cls, device_index: int) -> CupyKernels:
        with cls._lock:
            kernels = cls._by_device.get(device_index)
            if kernels is None:
                kernels = cls._by_device[device_index] = cls(device_index)
            return kernels

    def function(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            with self.cupy.cuda.Device(self.device_index):
                fn = self._functions[name] = self.module.get_function(name)
        return fn

    def stream(self, torch_stream: torch.cuda.Stream) -> Any:
        """CuPy's handle on torch's stream, so the kernels are ordered with the caller's torch work."""
        ptr = torch_stream.cuda_stream
        s = self._streams.get(ptr)
        if s is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older CuPy lacks its successor
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self._streams[ptr] = self.cupy.cuda.ExternalStream(ptr, self.device_index)
        return s


class _Plan:
    """Everything about a launch that depends only on the binding and the vector width."""

    __slots__ = ("gather_fn", "scatter_fn", "block", "tokens_per_cta", "head_args", "tail_args")

    def __init__(self, kernels: CupyKernels, binding: _Binding, layout: KVLayout, vec: int) -> None:
        import numpy as np

        self.gather_fn = kernels.function(f"kvm_gather_v{vec}")
        self.scatter_fn = kernels.function(f"kvm_scatter_v{vec}")
        head_vecs = layout.head_size * layout.itemsize // vec
        per_token = layout.kv_planes * layout.num_kv_heads * head_vecs
        _, self.block, self.tokens_per_cta = _launch_shape(per_token, 1, layout.num_layers)
        self.head_args = tuple(np.int64(v) for v in binding.strides)  # s_plane, s_block, s_offset, s_head
        self.tail_args = (
            np.int32(layout.kv_planes),
            np.int32(layout.num_kv_heads),
            np.int32(head_vecs),
            np.int32(layout.block_size),
            np.int32(self.tokens_per_cta),
        )


class _Binding:
    """Per-registration kernel arguments: device table of layer base pointers and the shared byte strides."""

    __slots__ = ("table", "table_arg", "strides", "align", "plans", "stream", "ends", "caches")

    def __init__(self, caches: list[torch.Tensor], layout: KVLayout) -> None:
        import numpy as np

        view = layout.kv_view(caches[0])  # [P, nb, bs, H, D]
        item = caches[0].element_size()
        s = view.stride()
        if s[4] != 1:
            raise ValueError("the head dimension of the KV cache must be contiguous")
        # Each canonical view starts at the tensor's own first element, so base pointer = data_ptr().
        ptrs = [c.data_ptr() for c in caches]
        self.caches = list(caches)  # keeps the ids in the key alive (and so unique) while bound
        self.ends = (ptrs[0], ptrs[-1])
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=caches[0].device)
        self.table_arg = np.uint64(self.table.data_ptr())
        self.strides = (s[0] * item, s[1] * item, s[2] * item, s[3] * item)
        align = layout.head_size * item
        for v in (*self.strides, *ptrs):
            align = _gcd(align, v)
        self.align = align
        self.plans: dict[tuple[int, int, int], _Plan] = {}
        self.stream: torch.cuda.Stream | None = None  # last stream that used `table`

    def release(self) -> None:
        if self.stream is not None:  # a kernel may still read the table: free it only after that stream's work
            self.table.record_stream(self.stream)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return abs(a)


class KernelLauncher:
    """The kernels' launches for one layout: the bindings of the KV caches it copies (a table of layer pointers per
    registration, kept), and the launch shape of each vector width."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._bindings: OrderedDict[tuple[Any, ...], _Binding] = OrderedDict()

    def _binding(self, caches: list[torch.Tensor]) -> _Binding:
        # vLLM registers its caches once and keeps them: the tensors' identities name the registration
        # (cheap), and the first and last addresses guard against a new set of tensors reusing those ids.
        key = tuple(map(id, caches))
        b = self._bindings.get(key)
        if b is not None and b.ends == (caches[0].data_ptr(), caches[-1].data_ptr()):
            return b
        if len(caches) != self.layout.num_layers:
            raise ValueError(f"expected {self.layout.num_layers} layer caches, got {len(caches)}")
        b = self._bindings[key] = _Binding(caches, self.layout)
        while len(self._bindings) > 8:
            self._bindings.popitem(last=False)[1].release()
        return b

    def launch(
        self,
        kernels: CupyKernels,
        gather_dir: bool,
        caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        chunk: torch.Tensor,
        skip: int,
    ) -> None:
        """Launch the gather (`gather_dir`: caches -> `chunk`) or the scatter (`chunk` -> caches, past the first
        `skip` tokens) on the current torch stream."""
        import numpy as np

        layout = self.layout
        if slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
        num_tokens = slot_mapping.numel()
        if not gather_dir and not 0 <= skip <= num_tokens:
            raise ValueError(f"skip_prefix must be in [0, {num_tokens}], got {skip}")
        if num_tokens == 0 or skip == num_tokens:
            return
        check_chunk(chunk, layout, num_tokens, "out" if gather_dir else "chunk")
        device = caches[0].device
        if chunk.device != device and not chunk.is_pinned():
            # The kernels reach host memory only when it is pinned: go through a device buffer.
            staged = chunk.to(device)
            self.launch(kernels, gather_dir, caches, slot_mapping, staged, skip)
            if gather_dir:
                chunk.copy_(staged)
            return
        stream = torch.cuda.current_stream(device)
        slots = slot_mapping
        if slots.device != device or slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
            slots.record_stream(stream)  # our copy: keep it until the kernel has read it
        binding = self._binding(caches)
        binding.stream = stream
        align = _gcd(binding.align, chunk.data_ptr())
        vec = next(w for w in _VEC_WIDTHS if align % w == 0)
        plan_key = (vec, THREADS_PER_CTA, TOKEN_ROUNDS)
        plan = binding.plans.get(plan_key)
        if plan is None:
            plan = binding.plans[plan_key] = _Plan(kernels, binding, layout, vec)
        grid = (-(-num_tokens // plan.tokens_per_cta), layout.num_layers, 1)
        args = (
            binding.table_arg,
            np.uint64(slots.data_ptr()),
            np.uint64(chunk.data_ptr()),
            *plan.head_args,
            np.int32(num_tokens),
            *plan.tail_args,
            np.int32(skip),
        )
        fn = plan.gather_fn if gather_dir else plan.scatter_fn
        if torch.cuda.current_device() != device.index:
            with torch.cuda.device(device), kernels.stream(stream):
                fn(grid, plan.block, args)
        else:  # CuPy shares the runtime's current device with torch
            with kernels.stream(stream):
                fn(grid, plan.block, args)
