"""State files (shared/store_kit/state_file.py): `CoalescedSave.save_now` waits for the file, and its callers share writes."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path


from kvmesh.shared.store_kit.chunk_index import ChunkIndex
from kvmesh.shared.store_kit.state_file import (CLAIMS_NAME, CoalescedSave, StoreState, read_msgpack, save_claims,
                                      write_atomically)

from support.waiting import WAIT_S, wait_until_async


class Counter:
    """A state that is a version number, written to `path` by real file writes that can be held back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.version = 0
        self.written: list[int] = []
        self.gate = threading.Event()  # a write waits for it (on the writer thread)
        self.gate.set()
        self.writing = threading.Event()

    def write(self, value: int) -> None:
        self.writing.set()
        assert self.gate.wait(WAIT_S), "the test never released the write"
        write_atomically(self.path, value)
        self.written.append(value)

    def saver(self, min_interval: float = 0.0) -> CoalescedSave[int]:
        return CoalescedSave("counter", lambda: self.version, lambda: self.version, self.write, min_interval)


async def test_callers_arriving_during_a_write_share_the_next_one(tmp_path: Path) -> None:
    state = Counter(tmp_path / "state.msgpack")
    saver = state.saver()
    state.gate.clear()
    state.version += 1
    first = asyncio.ensure_future(saver.save_now())
    await wait_until_async(state.writing.is_set, what="the first write under way")
    burst = []
    for _ in range(50):  # 50 changes, each with a caller waiting for it, while the first write is held
        state.version += 1
        burst.append(asyncio.ensure_future(saver.save_now()))
    await asyncio.sleep(0)  # let them all start waiting
    assert not any(task.done() for task in [first, *burst])  # nobody is answered before the file holds it
    state.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *burst), WAIT_S)
    assert state.written == [1, 51]  # two writes for 51 callers
    assert read_msgpack(state.path, "counter") == 51


async def test_save_now_does_not_wait_out_the_interval(tmp_path: Path) -> None:
    state = Counter(tmp_path / "state.msgpack")
    saver = state.saver(min_interval=3600.0)  # as the claims file: background saves spaced out
    state.version += 1
    saver.soon()
    await wait_until_async(lambda: state.written == [1], what="the first background save")
    state.version += 1
    saver.soon()  # would wait an hour
    await asyncio.wait_for(saver.save_now(), WAIT_S)
    assert state.written == [1, 2] and read_msgpack(state.path, "counter") == 2
    await saver.close()


async def test_a_failed_write_is_raised_to_every_caller_and_the_next_one_retries(tmp_path: Path) -> None:
    state = Counter(tmp_path / "state.msgpack")
    saver = state.saver()
    (tmp_path / "state.msgpack.tmp").mkdir()  # the temporary name is taken: the rewrite fails
    state.version += 1
    results = await asyncio.gather(saver.save_now(), saver.save_now(), return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results), results
    (tmp_path / "state.msgpack.tmp").rmdir()
    await asyncio.wait_for(saver.save_now(), WAIT_S)
    assert read_msgpack(state.path, "counter") == 1


class _Entry:
    """A chunk index entry: what it charges and holds."""

    def __init__(self, charge: int = 100, num_tokens: int = 16) -> None:
        self.charge, self.num_tokens = charge, num_tokens


def _held_after_restart(root: Path, keys: list[bytes]) -> tuple[ChunkIndex[_Entry], StoreState]:
    """A restarted store: its files give back `keys` (oldest first), then the pins and claims files are read."""
    index: ChunkIndex[_Entry] = ChunkIndex(10_000)
    for key in keys:
        index.load(key, _Entry())
    return index, StoreState(root, index)


def test_a_chunk_the_claims_file_does_not_name_is_dropped_at_start_never_kept_in_the_default_domain(
        tmp_path: Path) -> None:
    """Tenant B's chunk put just before a crash (the claims file, rewritten at most once a second, does not name
    it yet) must not come back in the default domain, where default engines would read what B wrote."""
    index: ChunkIndex[_Entry] = ChunkIndex(10_000)
    saved, unsaved = b"s" * 16, b"u" * 16
    index.reserve(saved, _Entry(), "engine.b.w0", domain="tenant-b")
    index.commit(saved)
    save_claims(tmp_path / CLAIMS_NAME, index.claim_table())  # a background save, then the crash
    index.reserve(unsaved, _Entry(), "engine.b.w0", domain="tenant-b")
    index.commit(unsaved)

    restarted, state = _held_after_restart(tmp_path, [saved, unsaved])
    restored = state.restore()
    assert [key for key, _ in restored.strays] == [unsaved]
    assert unsaved not in restarted and restarted.domain_of(saved) == "tenant-b"
    assert restarted.contains_prefix([saved], "tenant-b") == 1 and restarted.contains_prefix([saved], "default") == 0


def test_a_directory_without_a_claims_file_keeps_its_chunks_and_gets_one(tmp_path: Path) -> None:
    """A store from before claims (or a first start): its chunks are the default domain's, and from now on the
    claims file says what is known."""
    key = b"k" * 16
    restarted, state = _held_after_restart(tmp_path, [key])
    assert state.restore().strays == [] and key in restarted
    assert (tmp_path / CLAIMS_NAME).exists()
    again, state = _held_after_restart(tmp_path, [key])
    assert state.restore().strays == [] and key in again  # unclaimed, yet named: it was held when the file was made


def test_a_store_of_the_default_domain_alone_keeps_a_chunk_put_just_before_a_crash(tmp_path: Path) -> None:
    """Only the default domain can have put it: kept (unclaimed), so an engine's embedded store that dies with
    vLLM loses nothing. Once the map names another domain, the same chunk is dropped."""
    index: ChunkIndex[_Entry] = ChunkIndex(10_000)
    saved, unsaved = b"s" * 16, b"u" * 16
    index.reserve(saved, _Entry(), "engine.a.w0")
    index.commit(saved)
    save_claims(tmp_path / CLAIMS_NAME, index.claim_table())
    restarted, state = _held_after_restart(tmp_path, [saved, unsaved])
    assert state.restore().strays == [] and unsaved in restarted and restarted.domain_of(unsaved) == "default"
    restarted, state = _held_after_restart(tmp_path, [saved, unsaved])
    save_claims(tmp_path / CLAIMS_NAME, index.claim_table())  # the file from before the crash again
    assert [key for key, _ in state.restore(several_domains=True).strays] == [unsaved]
