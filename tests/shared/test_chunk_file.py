"""The chunk file: round trip, crash-safe writes, and corruption detected, never returned."""

import errno
import os
import struct
from pathlib import Path

import pytest

from kvmesh.shared import protocol

from kvmesh.shared.errors import StoreError
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.chunk_file import CorruptChunkFile

KEY = bytes(range(16))


def meta_for(data: bytes) -> protocol.ChunkMeta:
    return protocol.ChunkMeta(key=KEY, num_tokens=12, shape=[len(data)], dtype="uint8", fmt="raw",
                              nbytes=len(data), checksum=chunk_file.checksum(data))


def test_round_trip(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    path = chunk_file.write_chunk_file(tmp_path, meta_for(data), data)
    assert chunk_file.key_of_path(path) == KEY and path.parent.name == KEY.hex()[:2]
    meta, offset = chunk_file.read_chunk_meta(path)
    assert offset % chunk_file.DATA_ALIGN == 0 and meta == meta_for(data)
    out = bytearray(len(data) + 10)
    assert chunk_file.read_chunk_into(path, memoryview(out)) == meta_for(data)
    assert bytes(out[: len(data)]) == data


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "append"])
def test_corruption_detected(tmp_path: Path, damage: str) -> None:
    data = os.urandom(10_000)
    path = chunk_file.write_chunk_file(tmp_path, meta_for(data), data)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "magic":
        raw[0] ^= 0xFF
    else:
        raw += b"x"
    path.write_bytes(raw)
    with pytest.raises(CorruptChunkFile):
        chunk_file.read_chunk_into(path, memoryview(bytearray(len(data))))


def test_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        chunk_file.write_chunk_file(tmp_path, meta_for(b"abc"), b"abc")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_foreign_names_are_not_keys() -> None:
    assert chunk_file.key_of_path(Path("x/notakey.kvc")) is None
    assert chunk_file.key_of_path(Path(f"x/{KEY.hex()}.kvc.123.tmp")) is None


def test_the_header_check_covers_every_field_and_a_checksum_of_0_is_corrupt(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    path = chunk_file.write_chunk_file(tmp_path, meta_for(data), data)
    raw = path.read_bytes()
    # the header of another token count (a body of the same length) under the original header check
    start = len(chunk_file.MAGIC) + 4
    (length,) = struct.unpack("<I", raw[len(chunk_file.MAGIC):start])
    edited = chunk_file.encode_header(protocol.ChunkMeta(**{**meta_for(data).__dict__, "num_tokens": 13}))
    path.write_bytes(edited[:start + length] + raw[start + length:])
    with pytest.raises(CorruptChunkFile, match="header fails its check"):
        chunk_file.read_chunk_meta(path)
    # a header without a data checksum is corrupt, whatever its header check says; writing one is refused
    unchecked = protocol.ChunkMeta(**{**meta_for(data).__dict__, "checksum": 0})
    path.write_bytes(chunk_file.encode_header(unchecked) + data)
    with pytest.raises(CorruptChunkFile, match="no checksum"):
        chunk_file.read_chunk_into(path, memoryview(bytearray(len(data))))
    with pytest.raises(StoreError, match="no checksum"):
        chunk_file.write_chunk_file(tmp_path, unchecked, data)
    # a file of the previous format version (no header check) is not ours any more
    path.write_bytes(b"KVMESH\x01\x00" + raw[len(chunk_file.MAGIC):])
    with pytest.raises(CorruptChunkFile, match="bad magic"):
        chunk_file.read_chunk_meta(path)
