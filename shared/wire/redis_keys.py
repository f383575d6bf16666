"""The names of KVMesh's keys in Redis / Valkey, and how what they hold is authenticated.

`<p>` is `redis_key_prefix`, `<h>` a chunk key in hex (which already encodes the model and the KV format). The
braces are a cluster hash tag: one chunk's keys live on one shard, so one script can touch them all.
  * `<p>:chunk:{<h>}`        the value: VALUE_MAGIC, the MAC key's id, its MAC, the chunk-file header, the bytes
  * `<p>:pins:{<h>}`         set of pin entries `<random id>|<MAC>` (absent: not pinned)
  * `<p>:owners:{<h>}`       set of owner entries `<caller>|<MAC>`, the callers that put the chunk
  * `<p>:tmp:{<h>}:<n>`      a put being written
  * `<p>:claims:<caller>`    hash chunk hex -> tokens, what one caller put

Authentication (`RedisAuth`): anyone who can write under the prefix could otherwise plant a value with a valid
header and checksum, or pin and owner entries that keep a chunk from being evicted or cleared. So each value
carries an HMAC-SHA256 over (its key name, the header, the bytes), and each pin or owner entry a MAC over
(the set's key name, the entry): a value or entry that fails it is not ours. The MAC key derives from the
engine's secret (`remote_auth_secret_file`, else its sharing domain's secret); without one the MAC is keyed by
nothing secret, which still catches corruption, values moved between keys and old formats, not forgery.

A value also names the id of the key its MAC is under (`RedisAuth.key_id`: a digest of the MAC key, which tells
nothing of the key). A value under another key id was written by engines with another secret (another sharing
domain, or instances that do not share one) on the same prefix: not ours, so a miss, but left alone (deleting it
would make such engines delete each other's values forever). A value under our key id that fails its MAC is
forged or damaged, and is deleted.
"""

from __future__ import annotations

import hmac
import os
import struct
from pathlib import Path

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.wire.keys import KEY_BYTES, ChunkKey


VALUE_MAGIC = b"KVMRV\x02\x00\x00"  # a KVMesh Redis value, version 2 (key id, MAC); older values do not match
KEY_ID_BYTES = 8  # the id of the MAC key, right after VALUE_MAGIC
VALUE_TAG_BYTES = 32  # the value's MAC, after the key id
VALUE_PREFIX_BYTES = len(VALUE_MAGIC) + KEY_ID_BYTES + VALUE_TAG_BYTES
ENTRY_TAG_BYTES = 16  # a pin or owner entry's MAC (hex in the entry)
MIN_SECRET_BYTES = 16
SECRET_FILE_KEY = "remote_auth_secret_file"
_LENGTH = struct.Struct("<Q")

PREFIX_RULE = "must be non-empty, without braces or whitespace (braces are Redis cluster hash tags)"


def prefix_ok(prefix: str) -> bool:
    """Whether `prefix` can namespace keys (braces would break the hash tags): PREFIX_RULE."""
    return bool(prefix) and not any(c in prefix for c in "{} \t\r\n")


class RedisKeys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.chunk_pattern = f"{prefix}:chunk:*"  # SCAN / keyspace-notification pattern of every chunk value

    def chunk(self, key: ChunkKey) -> str:
        return f"{self.prefix}:chunk:{{{key.hex()}}}"

    def of_chunk(self, key: ChunkKey) -> list[str]:
        """chunk, pins, owners: one hash tag, one shard."""
        tag = f"{{{key.hex()}}}"
        return [f"{self.prefix}:chunk:{tag}", f"{self.prefix}:pins:{tag}", f"{self.prefix}:owners:{tag}"]

    def tmp(self, key: ChunkKey, n: int) -> str:
        return f"{self.prefix}:tmp:{{{key.hex()}}}:{n}"

    def claims(self, caller: str) -> str:
        return f"{self.prefix}:claims:{caller}"

    def key_of(self, name: str | bytes) -> ChunkKey | None:
        """The chunk key a value's name encodes; None for any other name (not ours, or malformed)."""
        text = name.decode(errors="replace") if isinstance(name, bytes) else name
        head = f"{self.prefix}:chunk:{{"
        if not (text.startswith(head) and text.endswith("}")):
            return None
        try:
            key = bytes.fromhex(text[len(head):-1])
        except ValueError:
            return None
        return key if len(key) == KEY_BYTES else None


# ---- authentication -----------------------------------------------------------------------------------------------
class RedisAuth:
    """MACs of what the Redis tier writes, keyed by a secret shared by the writers that may trust each other.

    `secret` None: keyed by nothing secret (anyone can compute the MAC: it only catches corruption, values
    moved between keys and old formats). `source` says where the secret came from, for logs."""

    def __init__(self, secret: bytes | None, source: str = "") -> None:
        self.keyed = secret is not None
        self.source = source if self.keyed else "no secret"
        # derived, so a secret used elsewhere (the domain's) never keys these MACs directly
        self._key = b"" if secret is None else hmac.digest(secret, b"kvmesh redis tier MAC key", "sha256")
        self.key_id = hmac.digest(self._key, b"kvmesh redis tier key id", "sha256")[:KEY_ID_BYTES]

    def value_tag(self, name: str, header: bytes | memoryview, data: bytes | memoryview) -> bytes:
        """The MAC of the value at key `name`: chunk-file header `header` then the chunk's bytes `data`.
        HMAC-SHA256: with the SHA extensions of current x86 and ARM CPUs, ~1.3 GB/s, about twice blake2b."""
        mac = hmac.new(self._key, b"value\0", "sha256")
        mac.update(_framed(name.encode()))
        mac.update(header)  # its length is in it; `data` is the rest of the value
        mac.update(data)
        return mac.digest()

    def value_prefix(self, name: str, header: bytes, data: bytes | memoryview) -> bytes:
        """What a value starts with: VALUE_MAGIC, the key id and its MAC (the header and the bytes follow)."""
        return VALUE_MAGIC + self.key_id + self.value_tag(name, header, data)

    def entry(self, set_name: str, member: str) -> str:
        """`member` as an entry of the set at `set_name` (a pin id, an owner caller): `<member>|<MAC>`."""
        return f"{member}|{self._entry_tag(set_name, member)}"

    def entry_ok(self, set_name: str, entry: str | bytes) -> bool:
        """Whether `entry` is one we wrote into the set at `set_name` (not forged, not moved from another set)."""
        text = entry.decode(errors="replace") if isinstance(entry, bytes) else entry
        member, bar, tag = text.rpartition("|")
        return bool(bar) and hmac.compare_digest(tag.encode(), self._entry_tag(set_name, member).encode())

    def _entry_tag(self, set_name: str, member: str) -> str:
        mac = hmac.new(self._key, b"entry\0", "sha256")
        mac.update(_framed(set_name.encode()))
        mac.update(member.encode())
        return mac.digest()[:ENTRY_TAG_BYTES].hex()


def _framed(part: bytes) -> bytes:
    return _LENGTH.pack(len(part)) + part


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The secret in `path` (`remote_auth_secret_file`): its bytes without surrounding whitespace, at least
    MIN_SECRET_BYTES of them (any form: hex, base64, raw). ConfigError naming the key and the problem."""
    where = f"{SECRET_FILE_KEY} {path}"
    file = Path(path)
    try:
        if file.stat().st_mode & 0o077:
            raise ConfigError(f"{where}: readable or writable by other users; chmod 600 it")
        secret = file.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: {len(secret)} bytes, a secret needs at least {MIN_SECRET_BYTES} (make one "
                          "with `head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > FILE`)")
    return secret


def secret_file_problem(path: str) -> str | None:
    """Why `path` cannot be `remote_auth_secret_file` (the config's check), or None."""
    try:
        read_secret_file(path)
    except ConfigError as exc:
        return str(exc).removeprefix(f"{SECRET_FILE_KEY} ")
    return None
