"""The memory pool's pages faulted in ahead of the slabs it carves, by a thread of its own, so a save into a slab
never used before does not pay a page fault (and the zeroing of the page) per 4 KiB on vLLM's model thread.

A fresh server's pool is all such pages until it fills: a 0.5 MiB save (one 256-token step's chunk and state of
the Qwen3-Next demo) took 2.5x as long into them as into pages used before, and 0.97x with this
(benchmarks/pool_fault_ahead.py). The pool carves its slabs front to back (memory_pool.py), so what the next
saves will write is the bytes just past the furthest slab carved: this keeps `ahead_bytes` past it faulted,
`STEP` at a time.

Faulting is `madvise(MADV_POPULATE_WRITE)` (Linux 5.14): the kernel maps each page as a write would, without
writing it, so it is safe while another thread writes into a slab carved meanwhile. The call goes through ctypes,
which releases the GIL for it. Where the kernel refuses it (older kernels, other systems), the thread stops and
saves fault their pages as before. With CUDA the pool is pinned (cudaHostRegister faults every page) and nothing
here runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it before 3.13
AHEAD_BYTES = 256 * 1024 * 1024  # the margin kept faulted: several chunks of a large model, seconds of saves
STEP = 8 * 1024 * 1024  # faulted per call: short, so a pool's close waits at most one step
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def populate(address: int, nbytes: int) -> int:
    """Fault in the pages of [address, address + nbytes) for writing, their contents untouched; 0, or the errno."""
    start = (address + _PAGE - 1) // _PAGE * _PAGE  # madvise wants a page-aligned start
    end = address + nbytes
    if end <= start:
        return 0
    if _libc.madvise(start, end - start, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


class FaultAhead:
    """Keeps the `ahead_bytes` past the furthest byte handed out (`advance`) of the buffer at `address` (`size`
    bytes) faulted in, from a daemon thread; `thread_setup` runs first on that thread (the engine moves it off
    vLLM's compute cores: mesh/side_cpus.py). `close` stops the thread and waits for it: call it before the buffer
    is unmapped."""

    def __init__(self, address: int, size: int, ahead_bytes: int,
                 thread_setup: Callable[[], None] | None = None, name: str = "kvmesh-pool-fault") -> None:
        self.address = address
        self.size = size
        self.ahead_bytes = ahead_bytes
        self.faulted = 0  # bytes from the start faulted in (or found unfaultable: then the thread stops)
        self._frontier = 0  # the end of the furthest region handed out
        self._closed = False
        self._wake = threading.Condition()
        self._thread_setup = thread_setup
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _target(self) -> int:
        return min(self.size, self._frontier + self.ahead_bytes)

    def advance(self, end: int) -> None:
        """The buffer is handed out up to `end`: fault further ahead when the margin is half used."""
        with self._wake:
            if end <= self._frontier:
                return
            self._frontier = end
            if self.faulted < min(self.size, end + self.ahead_bytes // 2):
                self._wake.notify()

    def wait_faulted(self, nbytes: int, timeout: float) -> bool:
        """Whether the first `nbytes` are faulted within `timeout` seconds (tests, benchmarks)."""
        with self._wake:
            return self._wake.wait_for(lambda: self.faulted >= min(nbytes, self.size) or self._closed, timeout) \
                and self.faulted >= min(nbytes, self.size)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._closed or self.faulted < self._target())
                if self._closed:
                    return
                start, end = self.faulted, min(self._target(), self.faulted + STEP)
            error = populate(self.address + start, end - start)
            with self._wake:
                if error:
                    log.info("cannot fault the CPU pool's pages ahead of use (madvise: %s): saves into fresh pages "
                             "fault them on vLLM's thread", os.strerror(error))
                    self._closed = True
                    self._wake.notify_all()
                    return
                self.faulted = end
                self._wake.notify_all()
