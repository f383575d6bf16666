"""The disk store's index snapshot: what start-up needs to know of each chunk file, so that a restart need not
read every file's header.

Written by the store (`write_snapshot`: every `snapshot_interval_secs` and at close) as `<root>/index.snapshot`,
crash-safely (temporary file, fsync, rename, directory fsync). Layout: `MAGIC` (8 bytes, its 7th the format
version) | record count (u64 LE) | xxh3 of the body (u64 LE) | body: one fixed-size record per chunk file
(key, data bytes, file bytes, token count, the file's mtime in ns).

Start-up (`scan`) trusts a snapshot only as far as it is checked, every byte of it being untrusted input: a
wrong magic or version, a body whose length is not the count's, a checksum mismatch, a record out of bounds
(sizes, a header page that is not whole pages) or a key twice reject the whole snapshot, and the store scans
every file as it did before snapshots (`chunk_file.scan_directory`), logging why. Of an accepted snapshot, a
record is used only for a regular file actually present at the key's path whose size and mtime_ns are the
record's: a file removed behind the snapshot is not indexed; a file added behind it, or whose size or mtime
differ (changed, or read since: reads set the mtime), gets the scan's checks of its name, header and length
(and is deleted if it fails them). A file indexed from its record had passed those checks when the store
indexed or wrote it (only held chunks are recorded, with their file's stat at snapshot time), and every read
still verifies the header, the key and the data checksum, dropping a file that fails: a snapshot never makes
the store serve bytes a read would have rejected.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import time
from pathlib import Path

import xxhash

from kvmesh.services.disk_store.index import Entry
from kvmesh.shared.store_kit.state_file import write_bytes_atomically
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES, ChunkKey

log = logging.getLogger(__name__)

SNAPSHOT_NAME = "index.snapshot"
MAGIC = b"KVMIDX\x01\x00"
_HEAD = struct.Struct("<8sQQ")  # magic, record count, xxh3 of the body
_RECORD = struct.Struct(f"<{KEY_BYTES}sQQIq")  # key, nbytes, file_bytes, num_tokens, mtime_ns
MAX_HEADER_BYTES = 1 << 20  # a chunk file's header page(s): far more than any real header takes

# what the scan hands the store: (mtime in seconds: the LRU order, key, entry)
Found = tuple[float, ChunkKey, Entry]
Record = tuple[ChunkKey, Entry, int]  # a snapshot's record: key, entry, the file's mtime_ns


class SnapshotRejected(Exception):
    """The snapshot file is not one this store wrote intact."""


def write_snapshot(root: Path, held: list[tuple[ChunkKey, Entry]]) -> int:
    """Record `held` (the index's held chunks) with their files' current stat; files gone or of another size
    than their entry are left out. Blocking (an I/O thread). How many records were written."""
    records = []
    for key, entry in held:
        try:
            st = os.stat(os.path.join(root, chunk_file.chunk_name(key)))
        except OSError:
            continue
        if st.st_size == entry.file_bytes:
            records.append(_RECORD.pack(key, entry.nbytes, entry.file_bytes, entry.num_tokens, st.st_mtime_ns))
    body = b"".join(records)
    write_bytes_atomically(root / SNAPSHOT_NAME, _HEAD.pack(MAGIC, len(records), xxhash.xxh3_64_intdigest(body))
                           + body)
    return len(records)


def read_snapshot(root: Path) -> dict[str, Record] | None:
    """The snapshot's records by their chunk file's name; None if there is none; SnapshotRejected if it is
    damaged."""
    try:
        raw = (root / SNAPSHOT_NAME).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotRejected(f"unreadable: {exc}") from None
    if len(raw) < _HEAD.size:
        raise SnapshotRejected(f"{len(raw)} bytes, shorter than its header")
    magic, count, digest = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise SnapshotRejected("not an index snapshot of this version (bad magic)")
    body = memoryview(raw)[_HEAD.size:]
    if len(body) != count * _RECORD.size:
        raise SnapshotRejected(f"{count} records need {count * _RECORD.size} bytes, the body has {len(body)} "
                               "(torn or padded)")
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise SnapshotRejected("the body fails its checksum")
    records: dict[str, Record] = {}
    for key, nbytes, file_bytes, num_tokens, mtime_ns in _RECORD.iter_unpack(body):
        header = file_bytes - nbytes
        if not (0 < header <= MAX_HEADER_BYTES and header % chunk_file.DATA_ALIGN == 0):
            raise SnapshotRejected(f"chunk {key.hex()}: {file_bytes} file bytes for {nbytes} data bytes")
        name = f"{key.hex()}{chunk_file.SUFFIX}"  # the name of its file (chunk_file.chunk_path)
        if name in records:
            raise SnapshotRejected(f"chunk {key.hex()} recorded twice")
        records[name] = (key, Entry(nbytes, file_bytes=file_bytes, num_tokens=num_tokens), mtime_ns)
    return records


def scan(root: Path, threads: int = 8) -> tuple[chunk_file.ScanReport, list[Found]]:
    """The chunk files under `root`, oldest mtime first: from the snapshot where it is intact and matches the
    file, else from the file's header (`chunk_file`'s checks; bad files and `*.tmp` are deleted). The report's
    `chunks` is empty (the found ones are the list returned)."""
    start = time.perf_counter()
    report = chunk_file.ScanReport(chunks=[])
    try:
        records = read_snapshot(root)
    except SnapshotRejected as exc:
        log.warning("disk store: %s/%s not used (%s); reading every chunk file's header", root, SNAPSHOT_NAME, exc)
        records, report.snapshot = None, f"rejected: {exc}"
    found: list[Found] = []
    if records is None:
        full = chunk_file.scan_directory(root, threads)
        report.removed_tmp, report.removed_corrupt = full.removed_tmp, full.removed_corrupt
        report.snapshot = report.snapshot or "none"
        found = [(c.mtime, c.meta.key, _entry_of(c)) for c in full.chunks]
    else:
        found, unmatched = _match(chunk_file.list_chunk_files(root, report), records)
        report.trusted = len(found)
        chunk_file.inspect_files(root, unmatched, report, threads)
        found += [(c.mtime, c.meta.key, _entry_of(c)) for c in report.chunks]
        report.chunks = []
        report.snapshot = "used"
    found.sort(key=lambda f: f[0])
    report.seconds = time.perf_counter() - start
    return report, found


def _match(entries: list[os.DirEntry[str]], records: dict[str, Record]) -> tuple[list[Found], list[Path]]:
    """Split the listed files into those their record describes (a regular file at the key's own path, of the
    record's size and mtime_ns) and those to inspect. One thread: a stat is a short syscall, the rest is Python."""
    trusted: list[Found] = []
    others: list[Path] = []
    for entry in entries:
        name = entry.name
        record = records.get(name)  # only a record's own name: lower-case hex of a whole key
        if record is not None and entry.path[-len(name) - 3:-len(name)] == f"{name[:2]}{os.sep}":  # its fan-out dir
            key, chunk, mtime_ns = record
            try:
                st = entry.stat()  # follows a link, as the scan's open does
            except OSError:
                st = None
            if (st is not None and stat.S_ISREG(st.st_mode) and st.st_size == chunk.file_bytes
                    and st.st_mtime_ns == mtime_ns):
                trusted.append((mtime_ns / 1e9, key, chunk))
                continue
        others.append(Path(entry.path))
    return trusted, others


def _entry_of(found: chunk_file.FoundChunk) -> Entry:
    return Entry(found.meta.nbytes, file_bytes=found.file_bytes, num_tokens=found.meta.num_tokens)
