"""The CPU pool's pages faulted in ahead of the slabs it carves (services/engine/tiers/fault_ahead.py): the pages are
mapped before a save writes them, their bytes untouched, never more than the margin past the furthest slab carved;
residency is read from the kernel (/proc/self/smaps), not from the pool's own count."""

from __future__ import annotations

import errno
import mmap

import numpy as np
import pytest
import torch

from kvmesh.services.engine.tiers.fault_ahead import populate
from kvmesh.services.engine.tiers.memory_pool import MemoryPool

from support.waiting import WAIT_S, wait_until

MiB = 1024 * 1024


def resident_bytes(address: int) -> int:
    """The resident bytes of this process's mapping that holds `address` (its smaps Rss)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: "start-end perms offset dev inode ..."
                start, end = (int(part, 16) for part in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def skip_without_populate(error: int) -> None:
    if error in (errno.EINVAL, errno.ENOSYS):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): the pool faults its pages on use")


def test_populate_maps_every_page_for_writing_and_leaves_their_bytes_as_they_were() -> None:
    region = mmap.mmap(-1, 16 * MiB, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8)
    address = array.__array_interface__["data"][0]
    array[:4096] = 7  # two pages written before, as a save into a slab carved meanwhile would
    array[8 * MiB:8 * MiB + 4096] = 9
    assert resident_bytes(address) == 2 * 4096

    skip_without_populate(populate(address, 16 * MiB))

    assert resident_bytes(address) == 16 * MiB
    assert (array[:4096] == 7).all() and (array[8 * MiB:8 * MiB + 4096] == 9).all()
    assert not array[4096:8 * MiB].any() and not array[8 * MiB + 4096:].any()
    del array
    region.close()


def test_a_pool_keeps_pages_faulted_past_its_furthest_slab_and_no_further() -> None:
    pool = MemoryPool(64 * MiB, 1 * MiB, use_shm=True, pin=False, fault_ahead_bytes=8 * MiB)
    assert pool.fault_ahead is not None
    address = pool.fault_ahead.address
    try:
        if not pool.fault_ahead.wait_faulted(8 * MiB, WAIT_S):
            skip_without_populate(populate(address, 4096))
        assert resident_bytes(address) == 8 * MiB  # the margin before any save: not the whole pool

        slots = [pool.allocate() for _ in range(6)]  # slabs 0-5 carved: past half the margin, it moves on
        assert all(slot is not None for slot in slots)
        wait_until(lambda: pool.fault_ahead is not None and pool.fault_ahead.faulted >= 14 * MiB,
                   what="faulted 8 MiB past the sixth slab")
        assert resident_bytes(address) == 14 * MiB
        for index, slot in enumerate(slots):
            assert slot is not None
            slot.tensor.fill_(index + 1)
        for index, slot in enumerate(slots):
            assert slot is not None
            assert torch.equal(slot.tensor, torch.full_like(slot.tensor, index + 1))
    finally:
        pool.close()
    assert pool.fault_ahead is not None and not pool.fault_ahead._thread.is_alive()


def test_a_pool_without_a_margin_starts_no_thread() -> None:
    pool = MemoryPool(8 * MiB, 1 * MiB, use_shm=False, pin=False, fault_ahead_bytes=0)
    try:
        assert pool.fault_ahead is None
        assert pool.allocate() is not None
    finally:
        pool.close()
