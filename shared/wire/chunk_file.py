"""The self-describing chunk file: one file per chunk, used by the disk store and the remote store.

Layout: `MAGIC` (8 bytes, its 7th the format version) | header length (u32 little-endian) | msgpack header
(ChunkMeta fields) | the header's own xxh3 (u64 LE) | zero padding to `DATA_ALIGN` | the chunk bytes. The data
starts aligned so it can be read straight into aligned buffers.

Integrity: `meta.checksum` is the xxh3 of the data and is never 0 (0 would mean "unverified": such a file is
corrupt); the header check covers every header field (key, sizes, token count, layout, the data checksum),
so nothing a reader is served from the file goes unchecked. Files of another version (version 1 had no
header check) do not match MAGIC: bad files, deleted at the start-up scan. Files are written to a temporary
name and renamed into place, so a file with the final name is complete; its checksums are still verified on
every read. File names derive from the chunk key only (`<hex key>.kvc`, fanned out by the first byte), never
from caller text.

A directory of chunk files (`<root>/<2 hex>/<32 hex>.kvc`) is rebuilt at start with `scan_directory`, the same
for both stores. Everything here is blocking file I/O: stores call it from worker threads or before serving.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack
import xxhash

from kvmesh.shared import protocol
from kvmesh.shared.errors import StoreError
from kvmesh.shared.wire.keys import KEY_BYTES, ChunkKey

log = logging.getLogger(__name__)

MAGIC = b"KVMESH\x02\x00"  # version 2: the header carries its own check
DATA_ALIGN = 4096
SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
_LEN = struct.Struct("<I")
_HEAD_CHECK = struct.Struct("<Q")


class CorruptChunkFile(StoreError):
    """A chunk file is truncated, has a bad header or fails its checksum."""


def checksum(data: memoryview | bytes) -> int:
    """xxh3 of a chunk's bytes: what `ChunkMeta.checksum` holds (0 is never valid, see `check_meta`)."""
    return xxhash.xxh3_64_intdigest(data)


def check_meta(meta: protocol.ChunkMeta) -> None:
    """Raise StoreError if `meta` cannot describe a verifiable chunk: every chunk carries its data checksum.

    A digest of exactly 0 (odds 2**-64) is refused too: 0 is how unverified metas used to say "not computed".
    """
    if meta.checksum == 0:
        name = meta.key.hex() if isinstance(meta.key, bytes) else f"{meta.key!r:.40}"
        raise StoreError(f"chunk {name}: no checksum (0 is never valid: the sender computes chunk_file.checksum "
                         "of the bytes)")


def chunk_path(root: Path, key: ChunkKey) -> Path:
    return root / chunk_name(key)


def chunk_name(key: ChunkKey) -> str:
    """A chunk file's path under its directory: `<2 hex>/<32 hex>.kvc` (a string: cheaper than a Path where
    a million are made)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    name = key.hex()
    return f"{name[:2]}/{name}{SUFFIX}"


def key_of_path(path: Path) -> ChunkKey | None:
    """The key a chunk file name encodes, or None for a name that is not one of ours."""
    stem = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else ""
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


def encode_header(meta: protocol.ChunkMeta) -> bytes:
    """MAGIC, length and msgpack header, zero-padded so the data that follows starts at DATA_ALIGN."""
    body = msgpack.packb({f: getattr(meta, f) for f in meta.__dataclass_fields__}, use_bin_type=True)
    head = MAGIC + _LEN.pack(len(body)) + body + _HEAD_CHECK.pack(checksum(body))
    return head + b"\0" * (-len(head) % DATA_ALIGN)


def fsync_directory(path: Path) -> None:
    """Make the names in directory `path` durable (a rename into it, a file created in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunk_file(root: Path, meta: protocol.ChunkMeta, data: memoryview | bytes, fsync: bool = True,
                     sync_directory: bool = False) -> Path:
    """Write a chunk crash-safely (temporary file, fsync, rename); returns the final path. With `sync_directory`
    the rename is made durable too (the file's directory and `root` fsync'd): once this returns, the file survives
    a power loss, not only a crash of the process.

    On any error the temporary file is removed and the error propagates; no partial file stays. A meta
    without a checksum raises StoreError: no file is ever written that a reader could not verify.
    """
    check_meta(meta)
    path = chunk_path(root, meta.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb", buffering=0) as f:
            f.write(encode_header(meta))
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += f.write(view[written:])
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_directory:
        fsync_directory(path.parent)
        fsync_directory(root)  # the fan-out directory may be new (cheap once it is not)
    return path


def read_header(f) -> tuple[protocol.ChunkMeta, int]:
    """Parse and verify the header of an open chunk file; returns the meta and the data offset."""
    name = getattr(f, "name", "?")
    prefix = f.read(len(MAGIC) + _LEN.size)
    if len(prefix) < len(MAGIC) + _LEN.size or prefix[: len(MAGIC)] != MAGIC:
        raise CorruptChunkFile(f"{name}: not a KVMesh chunk file of this version (bad magic)")
    (length,) = _LEN.unpack(prefix[len(MAGIC):])
    body = f.read(length)
    check = f.read(_HEAD_CHECK.size)
    if len(body) < length or len(check) < _HEAD_CHECK.size or _HEAD_CHECK.unpack(check)[0] != checksum(body):
        raise CorruptChunkFile(f"{name}: header fails its check")
    try:
        fields = msgpack.unpackb(body, raw=False)
        meta = protocol.ChunkMeta(**fields)
        check_meta(meta)
    except Exception as exc:
        raise CorruptChunkFile(f"{name}: bad header ({exc})") from None
    head = len(prefix) + length + _HEAD_CHECK.size
    return meta, head + (-head % DATA_ALIGN)


def read_chunk_meta(path: Path) -> tuple[protocol.ChunkMeta, int]:
    """Header of a chunk file, checking that the file is as long as the header says."""
    with open(path, "rb") as f:
        meta, offset = read_header(f)
        size = os.fstat(f.fileno()).st_size
    if size != offset + meta.nbytes:
        raise CorruptChunkFile(f"{path}: {size} bytes, expected {offset + meta.nbytes} (truncated or padded)")
    return meta, offset


def read_chunk_into(path: Path, out: memoryview) -> protocol.ChunkMeta:
    """Read a chunk's bytes into `out` (at least meta.nbytes long) and verify the checksum."""
    with open(path, "rb", buffering=0) as f:
        meta, offset = read_header(f)
        if len(out) < meta.nbytes:
            raise StoreError(f"{path}: buffer of {len(out)} bytes is too small for {meta.nbytes}")
        f.seek(offset)
        target = out[: meta.nbytes]
        done = 0
        while done < meta.nbytes:
            n = f.readinto(target[done:])
            if not n:
                raise CorruptChunkFile(f"{path}: truncated at {offset + done} bytes")
            done += n
        if f.read(1):
            raise CorruptChunkFile(f"{path}: trailing bytes after the data")
    if checksum(target) != meta.checksum:  # never 0: read_header refused that
        raise CorruptChunkFile(f"{path}: checksum mismatch")
    return meta


# ---- directories of chunk files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FoundChunk:
    """A chunk file found by `scan_directory`: its header, where its data starts, its path and its mtime."""

    meta: protocol.ChunkMeta
    data_offset: int
    path: Path
    mtime: float  # set at write and, by the disk store, at every read: the LRU order across restarts

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.meta.nbytes


@dataclass
class ScanReport:
    chunks: list[FoundChunk]  # least recently used (oldest mtime) first
    removed_tmp: int = 0
    removed_corrupt: int = 0
    seconds: float = 0.0
    trusted: int = 0  # files a store took from its index snapshot without reading them (disk store)
    snapshot: str = ""  # what became of that snapshot: "used", or why not


def scan_directory(root: Path, threads: int = 8) -> ScanReport:
    """Index the chunk files under `root` from their headers; delete leftovers and bad files.

    `*.tmp` files (writes cut short by a crash) are deleted; a `.kvc` file whose name is not a chunk path of
    `root`, whose header is unreadable, whose length disagrees with its header, or whose header names another
    key is deleted, as is one of another format version or whose header fails its check (or has no data
    checksum). Data checksums are verified on every read, not here, so the scan stays fast (one small read per
    file, on `threads` threads).
    """
    start = time.perf_counter()
    report = ScanReport(chunks=[])
    inspect_files(root, [Path(entry.path) for entry in list_chunk_files(root, report)], report, threads)
    report.chunks.sort(key=lambda c: c.mtime)
    report.seconds = time.perf_counter() - start
    return report


def list_chunk_files(root: Path, report: ScanReport) -> list[os.DirEntry[str]]:
    """The `.kvc` files in `root`'s fan-out directories (os.scandir's entries: their stat is cheap); `*.tmp`
    files are deleted (counted in `report`)."""
    candidates: list[os.DirEntry[str]] = []
    for fan in sorted(root.iterdir()) if root.is_dir() else []:
        if not (fan.is_dir() and len(fan.name) == 2):
            continue
        with os.scandir(fan) as entries:
            for entry in entries:
                if entry.name.endswith(TMP_SUFFIX):
                    Path(entry.path).unlink(missing_ok=True)
                    report.removed_tmp += 1
                elif entry.name.endswith(SUFFIX):
                    candidates.append(entry)
    return candidates


def list_chunk_names(root: Path, report: ScanReport, remove_tmp: bool = True) -> tuple[set[str], list[Path]]:
    """`list_chunk_files` by name only (os.listdir: no object or stat per file, for a start of 10^6 files): the
    names of the `.kvc` files in their own fan-out directory (the one their first two characters name), and the
    paths of those in another (misplaced: `inspect_files` deletes them); `*.tmp` files are deleted (counted) unless
    not `remove_tmp` (a running store's writes in flight are `*.tmp` files)."""
    names: set[str] = set()
    misplaced: list[Path] = []
    for fan in sorted(root.iterdir()) if root.is_dir() else []:
        if not (fan.is_dir() and len(fan.name) == 2):
            continue
        listed, own = os.listdir(fan), fan.name
        for name in [n for n in listed if n.endswith(TMP_SUFFIX)] if remove_tmp else []:
            (fan / name).unlink(missing_ok=True)
            report.removed_tmp += 1
        chunks = [n for n in listed if n.endswith(SUFFIX)]
        names.update(n for n in chunks if n.startswith(own))
        misplaced += [fan / n for n in chunks if not n.startswith(own)]
    return names, misplaced


def inspect_files(root: Path, paths: list[Path], report: ScanReport, threads: int = 8) -> None:
    """Check each file's name, header and length (`scan_directory`'s checks): the good ones join
    `report.chunks` (unsorted), the bad ones are deleted."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="chunk-scan") as pool:
        results = list(pool.map(lambda p: inspect_file(root, p), paths))
    for path, found in zip(paths, results):
        if found is None:
            path.unlink(missing_ok=True)
            report.removed_corrupt += 1
        else:
            report.chunks.append(found)


def inspect_file(root: Path, path: Path) -> FoundChunk | None:
    """`inspect_files`' checks of one file (logged when it fails them): what it holds, or None. Deletes nothing."""
    key = key_of_path(path)
    if key is None or chunk_path(root, key) != path:
        log.warning("%s: not a chunk file name of this directory; deleting it", path)
        return None
    try:
        meta, offset = read_chunk_meta(path)
        mtime = path.stat().st_mtime
    except (CorruptChunkFile, OSError) as exc:
        log.warning("deleting bad chunk file: %s", exc)
        return None
    if meta.key != key:
        log.warning("%s: header names key %s; deleting it", path, meta.key.hex())
        return None
    return FoundChunk(meta, offset, path, mtime)


def unlink_chunk(root: Path, key: ChunkKey, only_inode: int | None = None) -> bool:
    """Delete a chunk's file; with `only_inode`, only if the name still points at that file (a newer write of
    the same key may have replaced it meanwhile). True if a file was deleted."""
    path = chunk_path(root, key)
    try:
        if only_inode is not None and path.stat().st_ino != only_inode:
            return False
        path.unlink()
        return True
    except FileNotFoundError:
        return False
