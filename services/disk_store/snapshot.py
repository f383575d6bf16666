"""The disk store's index snapshot: what start-up needs to know of each chunk file, so that a restart need not
read every file's header.

Written by the store (`write_snapshot`: every `snapshot_interval_secs` and at close) as `<root>/index.snapshot`,
crash-safely (temporary file, fsync, rename, directory fsync). Layout (version 3): `MAGIC` (8 bytes, its 7th the
format version) | record count | xxh3 of the body | flags | retained count (each a u64 LE) | body: one fixed-size
record per chunk file (key, data bytes, file bytes, token count, the file's mtime in ns), then one fixed-size
record per retained chunk (key, priority, wall-clock lease end in unix seconds or 0 for none, owner's index), then
the owners (the principals whose `--retained-share` each retention counts against) as a msgpack list of strings.
A version 2 snapshot (no retained count, no retention records) still loads: its chunks are unretained.

Retention (a put's kv_priority and lease, ChunkIndex.retain_put) is client input persisted, so it is read back
as such: a priority above MAX_PRIORITY, a lease end that is not a number, or an owner the list does not name drops
that retention; a lease end past the 30-day horizon (MAX_LEASE_SECS from now) is clamped to it; each is counted
(`Records.retention_dropped`). The store re-takes the rest within each owner's share of the capacity as it is now
(shared/store_kit/retention_restore.py), so a snapshot never lets a principal keep more than a put could. The bounds are
retention_restore.py's `bounded_retention`, the same as for a store's retention file (state_file.py). The lease end is
wall-clock, so a lease keeps ending on time across the restart. A chunk found without a record is unretained.

Start-up (`scan`) trusts a snapshot only as far as it is checked, every byte of it being untrusted input: a
wrong magic or version, a body whose length is not the count's, a checksum mismatch, a record out of bounds
(sizes, a header page that is not whole pages) or a key twice reject the whole snapshot, and the store scans
every file as it did before snapshots (`chunk_file.scan_directory`), logging why. Of an accepted snapshot, a
record is used only for a file listed at the key's own path: a file removed behind the snapshot is not indexed; a
file added behind it (a put after the last snapshot, before a crash) gets the scan's checks of its name, header and
length before the store serves (and is deleted if it fails them), so the byte cap counts every file listed.

A snapshot written at a clean stop with no write in flight is complete (`COMPLETE`): it names every file the store
had, so the next start serves from it without listing the directory, and lists it while serving (`find_added`:
files copied in behind the store are indexed if they pass the header checks, else deleted). A periodic one (what a
crash leaves) is listed against before serving, as above.

A start stats nothing (and from a complete snapshot lists nothing), so that 10^6 files start in seconds: the
stat of each file taken from its record (a regular file of the record's size and mtime_ns) is checked while the
store serves (`check_trusted`, DiskStore.check_snapshot_files). A file that fails it gets the scan's checks then:
dropped and deleted when it fails them or names other sizes than its record, kept when it passes (a read since the
snapshot sets the mtime). Until then the store may serve from a file changed behind it, but every read verifies the
header, the key and the data checksum, dropping a file that fails: a snapshot never makes the store serve bytes a
read would have rejected. What the record's sizes may get wrong until the check (a file changed behind the store)
is the byte count of that file; a forged snapshot can say what it likes of sizes, but whoever can write it can
also delete the files.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import time
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter
from pathlib import Path

import msgpack
import numpy as np
import xxhash

from kvmesh.services.disk_store.index import Entry
from kvmesh.shared.store_kit.retention_restore import bounded_retention
from kvmesh.shared.store_kit.state_file import write_bytes_atomically
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES, ChunkKey

log = logging.getLogger(__name__)

SNAPSHOT_NAME = "index.snapshot"
MAGIC = b"KVMIDX\x03\x00"
_HEAD = struct.Struct("<8sQQQQ")  # magic, record count, xxh3 of the body, flags, retained count
MAGIC_V2 = b"KVMIDX\x02\x00"  # before retention: still read
_HEAD_V2 = struct.Struct("<8sQQQ")  # magic, record count, xxh3 of the body, flags
COMPLETE = 1  # flag: written at a clean stop with no write in flight: it records every chunk file the store had
_RECORD = struct.Struct(f"<{KEY_BYTES}sQQIq")  # key, nbytes, file_bytes, num_tokens, mtime_ns
MAX_HEADER_BYTES = 1 << 20  # a chunk file's header page(s): far more than any real header takes

_RECORD_DTYPE = np.dtype([("key", f"V{KEY_BYTES}"), ("nbytes", "<u8"), ("file_bytes", "<u8"), ("num_tokens", "<u4"),
                          ("mtime_ns", "<i8")])  # _RECORD as a numpy record (packed: the same 44 bytes)
assert _RECORD_DTYPE.itemsize == _RECORD.size
_RETAINED = struct.Struct(f"<{KEY_BYTES}sIdI")  # key, priority, lease end (unix seconds; 0: none), owner's index
_RETAINED_DTYPE = np.dtype([("key", f"V{KEY_BYTES}"), ("priority", "<u4"), ("lease_end", "<f8"),
                            ("owner", "<u4")])
assert _RETAINED_DTYPE.itemsize == _RETAINED.size
MAX_OWNER_CHARS = 1024  # a principal's name: far more than any real one


@dataclass(frozen=True)
class Retained:
    """A chunk's persisted retention, bounds checked: lease_end is wall-clock (None: no lease)."""

    key: ChunkKey
    owner: str
    priority: int
    lease_end: float | None


@dataclass
class Records:
    """A snapshot's records, checked, oldest mtime first (the LRU order)."""

    keys: list[ChunkKey]
    entries: list[Entry]
    mtime_ns: list[int]
    complete: bool = False  # COMPLETE: no file was put after it
    retained: list[Retained] = field(default_factory=list)  # the retained chunks' retention, bounds checked
    retention_dropped: int = 0  # retentions read out of bounds: dropped, or their lease end clamped

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class Scan:
    """What a start found: the chunks to index (`held`: key to entry, least recently used first, for the index to
    adopt); `trusted`, those of them taken from the snapshot unchecked, for `check_trusted`."""

    report: chunk_file.ScanReport
    held: dict[ChunkKey, Entry]
    trusted: Records
    listed: bool = True  # False: a complete snapshot, the directory not listed yet (`find_added`, later)
    retained: list[Retained] = field(default_factory=list)  # the snapshot's retentions (of keys it recorded)
    retention_dropped: int = 0  # of them out of bounds (Records.retention_dropped)


class SnapshotRejected(Exception):
    """The snapshot file is not one this store wrote intact."""


def write_snapshot(root: Path, held: list[tuple[ChunkKey, Entry]], complete: bool = False,
                   retained: list[tuple[ChunkKey, str, int, float | None]] | None = None) -> int:
    """Record `held` (the index's held chunks) with their files' current stat; files gone or of another size
    than their entry are left out; `complete` when no write can land after it (a clean stop); `retained`: the
    retained chunks' (key, owner, priority, wall-clock lease end or None), ChunkIndex.retentions. Blocking (an I/O
    thread). How many records were written."""
    records = []
    for key, entry in held:
        try:
            st = os.stat(os.path.join(root, chunk_file.chunk_name(key)))
        except OSError:
            continue
        if st.st_size == entry.file_bytes:
            records.append(_RECORD.pack(key, entry.nbytes, entry.file_bytes, entry.num_tokens, st.st_mtime_ns))
    owners: dict[str, int] = {}
    retentions = [_RETAINED.pack(key, priority, lease_end or 0.0, owners.setdefault(owner, len(owners)))
                  for key, owner, priority, lease_end in retained or []]
    body = b"".join([*records, *retentions, msgpack.packb(list(owners), use_bin_type=True)])
    write_bytes_atomically(root / SNAPSHOT_NAME, _HEAD.pack(MAGIC, len(records), xxhash.xxh3_64_intdigest(body),
                                                             COMPLETE if complete else 0, len(retentions)) + body)
    return len(records)


def read_snapshot(root: Path) -> tuple[Records, dict[ChunkKey, Entry]] | None:
    """The snapshot's records, oldest mtime first, and the same as a dict (key: entry, for the index); None if
    there is none; SnapshotRejected if it is damaged. Decoded and checked as arrays (numpy): a start of 10^6
    records spends no Python call per record on them but the dict's."""
    try:
        raw = (root / SNAPSHOT_NAME).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotRejected(f"unreadable: {exc}") from None
    head = _HEAD_V2 if raw[:len(MAGIC_V2)] == MAGIC_V2 else _HEAD
    if len(raw) < head.size:
        raise SnapshotRejected(f"{len(raw)} bytes, shorter than its header")
    magic, count, digest, flags, *rest = head.unpack_from(raw)
    if magic not in (MAGIC, MAGIC_V2):
        raise SnapshotRejected("not an index snapshot of this version (bad magic)")
    retained_count = rest[0] if rest else 0
    body = memoryview(raw)[head.size:]
    records_end = count * _RECORD.size
    retained_end = records_end + retained_count * _RETAINED.size
    owners_bytes = len(body) - retained_end  # version 3 ends with the owners' list: a msgpack value, 1 byte or more
    fits = owners_bytes == 0 if head is _HEAD_V2 else owners_bytes >= 1
    if not fits:
        raise SnapshotRejected(f"{count} records and {retained_count} retentions do not fit a body of "
                               f"{len(body)} bytes (torn or padded)")
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise SnapshotRejected("the body fails its checksum")
    table = np.frombuffer(body[:records_end], dtype=_RECORD_DTYPE)
    header = table["file_bytes"] - table["nbytes"]  # unsigned: a file smaller than its data wraps far past the cap
    bad = (header == 0) | (header > MAX_HEADER_BYTES) | (header % chunk_file.DATA_ALIGN != 0)
    if bad.any():
        first = table[int(np.argmax(bad))]
        raise SnapshotRejected(f"chunk {bytes(first['key']).hex()}: {first['file_bytes']} file bytes for "
                               f"{first['nbytes']} data bytes")
    mtime_ns = table["mtime_ns"]
    if not (mtime_ns[1:] >= mtime_ns[:-1]).all():  # written in the index's LRU order: mostly sorted already
        table = table[np.argsort(mtime_ns, kind="stable")]
    keys: list[ChunkKey] = table["key"].tolist()
    entries = _shared_entries(table)
    held = dict(zip(keys, entries))  # the index's own dict, oldest first (ChunkIndex.load_many)
    if len(held) != len(keys):
        seen: set[ChunkKey] = set()
        twice = next(key for key in keys if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise SnapshotRejected(f"chunk {twice.hex()} recorded twice")
    retained, dropped = _read_retained(body[records_end:retained_end], body[retained_end:]) if rest else ([], 0)
    return Records(keys, entries, table["mtime_ns"].tolist(), complete=bool(flags & COMPLETE), retained=retained,
                   retention_dropped=dropped), held


def _read_retained(records: memoryview, owners_packed: memoryview) -> tuple[list[Retained], int]:
    """The retention records, bounds checked (see the module's doc), and how many were dropped or clamped.
    SnapshotRejected when the owners are not a msgpack list of strings. No Python work per chunk but the retained
    ones'."""
    table = np.frombuffer(records, dtype=_RETAINED_DTYPE)
    try:
        owners = msgpack.unpackb(owners_packed, raw=False, max_str_len=MAX_OWNER_CHARS, max_bin_len=0,
                                 max_array_len=max(len(table), 1), max_map_len=0, max_ext_len=0)
    except Exception as exc:
        raise SnapshotRejected(f"unreadable retention owners ({exc})") from None
    if not isinstance(owners, list) or not all(isinstance(owner, str) for owner in owners):
        raise SnapshotRejected("the retention owners are not a list of names")
    retained, dropped, now = [], 0, time.time()
    for key, priority, lease_end, owner in table.tolist():  # few: only the retained chunks
        bounded = bounded_retention(priority, lease_end, now) if owner < len(owners) else None
        if bounded is not None:
            retained.append(Retained(bytes(key), owners[owner], bounded[0], bounded[1]))
        dropped += bounded is None or bounded[2]
    return retained, dropped


def _shared_entries(table: np.ndarray) -> list[Entry]:
    """The records' entries, one object per distinct (nbytes, file_bytes, num_tokens): a store's chunks are mostly
    of one size, and then no sort is needed to find that out."""
    columns = [table["nbytes"], table["file_bytes"], table["num_tokens"].astype(np.uint64)]
    if len(table) == 0:
        return []
    if all((column == column[0]).all() for column in columns):
        return [Entry(*(int(column[0]) for column in columns))] * len(table)
    kinds, which = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)
    made = [Entry(nbytes, file_bytes=file_bytes, num_tokens=num_tokens) for nbytes, file_bytes, num_tokens
            in kinds.tolist()]
    return list(map(made.__getitem__, which.reshape(-1).tolist()))


def scan(root: Path, threads: int = 8) -> Scan:
    """The chunk files under `root`, oldest mtime first: from the snapshot for each file it records that is listed
    at the key's own path (its stat is checked later: `check_trusted`), else from the file's header (`chunk_file`'s
    checks; bad files and `*.tmp` are deleted). The report's `chunks` is empty. Column-wise, a few passes in C
    where it can: a start of 10^6 files."""
    start = time.perf_counter()
    report = chunk_file.ScanReport(chunks=[])
    (root / f"{SNAPSHOT_NAME}.tmp").unlink(missing_ok=True)  # a snapshot write a crash cut short (the store is locked)
    try:
        read = read_snapshot(root)
    except SnapshotRejected as exc:
        log.warning("disk store: %s/%s not used (%s); reading every chunk file's header", root, SNAPSHOT_NAME, exc)
        read, report.snapshot = None, f"rejected: {exc}"
    trusted = Records([], [], [])
    if read is None:
        full = chunk_file.scan_directory(root, threads)
        report.removed_tmp, report.removed_corrupt = full.removed_tmp, full.removed_corrupt
        report.snapshot = report.snapshot or "none"
        inspected = full.chunks
    elif read[0].complete:  # a clean stop's: every file is recorded, so the store serves before it lists them
        records, held = read
        report.trusted, report.snapshot = len(records), "used"
        report.seconds = time.perf_counter() - start
        return Scan(report, held, records, listed=False, retained=records.retained,
                    retention_dropped=records.retention_dropped)
    else:
        records = read[0]
        listed, others = chunk_file.list_chunk_names(root, report)
        names = [key.hex() + chunk_file.SUFFIX for key in records.keys]  # their files' names (chunk_file.chunk_name)
        added = listed.difference(names)  # listed without a record: added behind the snapshot
        trusted = records
        if len(listed) - len(added) != len(records):  # some recorded files are gone: keep the others' records
            present = [name in listed for name in names]
            trusted = Records(*(list(compress(column, present)) for column in
                                (records.keys, records.entries, records.mtime_ns)))
        others += [root / name[:2] / name for name in added]
        report.trusted = len(trusted)
        chunk_file.inspect_files(root, others, report, threads)
        inspected, report.chunks = report.chunks, []
        report.snapshot = "used"
    keys, entries = trusted.keys, trusted.entries
    if inspected:  # merged into the snapshot's mtime order (two sorted runs: one pass of the sort)
        merged = sorted([*zip((t / 1e9 for t in trusted.mtime_ns), keys, entries),
                         *((c.mtime, c.meta.key, _entry_of(c)) for c in inspected)], key=itemgetter(0))
        keys, entries = [key for _, key, _ in merged], [entry for _, _, entry in merged]
    report.seconds = time.perf_counter() - start
    retained, dropped = (read[0].retained, read[0].retention_dropped) if read is not None else ([], 0)
    return Scan(report, dict(zip(keys, entries)), trusted, retained=retained, retention_dropped=dropped)


def find_added(root: Path, recorded: list[ChunkKey]) -> tuple[list[tuple[ChunkKey, Entry | None]], int]:
    """After a start from a complete snapshot (blocking: an I/O thread, while the store serves): the chunk files
    listed at their own path that no record names (copied in behind the store), each with what its header says
    (None: it fails the checks); and how many misplaced files (in another fan-out directory) were deleted.
    `*.tmp` files are left alone: they are the store's writes in flight."""
    report = chunk_file.ScanReport(chunks=[])
    listed, misplaced = chunk_file.list_chunk_names(root, report, remove_tmp=False)
    listed.difference_update(key.hex() + chunk_file.SUFFIX for key in recorded)
    chunk_file.inspect_files(root, misplaced, report)  # no chunk's own path: deleted here
    added = []
    for name in listed:
        found = chunk_file.inspect_file(root, root / name[:2] / name)
        key = chunk_file.key_of_path(root / name[:2] / name)
        if key is not None:
            added.append((key, _entry_of(found) if found is not None else None))
    return added, report.removed_corrupt


def check_trusted(root: Path, keys: list[ChunkKey], entries: list[Entry],
                  mtime_ns: list[int]) -> list[tuple[ChunkKey, Entry | None]]:
    """The stat check a start from the snapshot leaves for later (blocking: an I/O thread): of the files taken from
    their records, those that are not a regular file of the record's size and mtime_ns, each with what its header
    says now (`chunk_file`'s checks of name, header and length; None: missing or bad). A file read after the
    snapshot (reads set the mtime) is one of them, with its own sizes."""
    changed: list[tuple[ChunkKey, Entry | None]] = []
    for key, entry, recorded_ns in zip(keys, entries, mtime_ns):
        path = os.path.join(root, chunk_file.chunk_name(key))
        try:
            st = os.stat(path)  # follows a link, as a read's open does
        except OSError:
            changed.append((key, None))
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size == entry.file_bytes and st.st_mtime_ns == recorded_ns:
            continue
        found = chunk_file.inspect_file(root, Path(path))  # not deleted here: the store may have rewritten it since
        changed.append((key, _entry_of(found) if found is not None else None))
    return changed


def _entry_of(found: chunk_file.FoundChunk) -> Entry:
    return Entry(found.meta.nbytes, file_bytes=found.file_bytes, num_tokens=found.meta.num_tokens)
