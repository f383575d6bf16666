"""The names of KVMesh's keys in Redis / Valkey, and how what they hold is authenticated.

`<p>` is `redis_key_prefix`, `<h>` a chunk key in hex (which already encodes the model and the KV format). The
braces are a cluster hash tag: one chunk's keys live on one shard, so one script can touch them all.
  * `<p>:chunk:{<h>}`        the value: VALUE_MAGIC, the key id, a nonce, the chunk-file header, the bytes
                             encrypted (AES-256-GCM), the tag
  * `<p>:pins:{<h>}`         set of pin entries `<random id>|<MAC>` (absent: not pinned)
  * `<p>:owners:{<h>}`       set of owner entries `<caller>|<MAC>`, the callers that put the chunk
  * `<p>:tmp:{<h>}:<n>`      a put being written
  * `<p>:claims:<caller>`    hash chunk hex -> tokens, what one caller put

Authentication and encryption (`RedisAuth`): anyone who can write under the prefix could otherwise plant a value
with a valid header and checksum, or pin and owner entries that keep a chunk from being evicted or cleared; anyone
who can read it could read the prompts' KV (from which their tokens can be recovered). So each value's bytes are
sealed with AES-256-GCM, its associated data the value's key name and the chunk-file header: a value written
without the key, moved from another key name, or whose header or bytes were changed fails its tag. Each pin or
owner entry carries an HMAC over (the set's key name, the entry). The sealing is shared/wire/aead.py's, as the
stores' chunks' are (services/engine/tiers/sealed.py). Both keys derive from the engine's secret
(`remote_auth_secret_file`, else its sharing domain's secret), on the engine: Redis holds only ciphertext. Without
a secret the keys derive from nothing secret, which still catches corruption, values moved between keys and old
formats, but neither forgery nor reading.

A value also names the id of its key (`RedisAuth.key_id`: a digest of the MAC key, which tells nothing of either
key). A value under another key id was written by engines with another secret (another sharing domain, or
instances that do not share one) on the same prefix: not ours, so a miss, but left alone (deleting it would make
such engines delete each other's values forever). A value under our key id that fails its tag is forged or
damaged, and is deleted. Rotating the secret so makes every value a miss under the new key id (they expire by
their TTL or are evicted). Nonces are 12 random bytes per put: far below the 2^32 seals per key that random
GCM nonces allow.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.wire.aead import KEY_ID_BYTES, NONCE_BYTES, TAG_BYTES, Aead, derive, framed
from kvmesh.shared.wire.keys import KEY_BYTES, ChunkKey


VALUE_MAGIC = b"KVMRV\x03\x00\x00"  # a KVMesh Redis value, version 3 (sealed); older values do not match
# after VALUE_MAGIC: the id of the keys (KEY_ID_BYTES), the value's AES-GCM nonce (NONCE_BYTES); the tag at the end
VALUE_TAG_BYTES = TAG_BYTES
VALUE_PREFIX_BYTES = len(VALUE_MAGIC) + KEY_ID_BYTES + NONCE_BYTES  # then the header, the sealed bytes, the tag
ENTRY_TAG_BYTES = 16  # a pin or owner entry's MAC (hex in the entry)
MIN_SECRET_BYTES = 16
SECRET_FILE_KEY = "remote_auth_secret_file"

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

    def retained(self, principal: str) -> str:
        """The engine principal's retained chunks (services/engine/tiers/redis_retention.py): one key, one shard."""
        return f"{self.prefix}:retained:{{{principal}}}"

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
    """The keys that seal Redis values and MAC pin and owner entries, derived from a secret shared by the writers
    that may trust each other.

    `secret` None: keyed by nothing secret (anyone can compute them: they only catch corruption, values moved
    between keys and old formats). `source` says where the secret came from, for logs."""

    def __init__(self, secret: bytes | None, source: str = "") -> None:
        self.keyed = secret is not None
        self.source = source if self.keyed else "no secret"
        # derived, so a secret used elsewhere (the domain's) never keys anything here directly
        self._key = b"" if secret is None else derive(secret, b"kvmesh redis tier MAC key")
        self.key_id = derive(self._key, b"kvmesh redis tier key id")[:KEY_ID_BYTES]
        self._aead = Aead(derive(self._key, b"kvmesh redis tier value key"))

    def seal_value(self, name: str, header: bytes, data: bytes | memoryview, out: memoryview) -> bytes:
        """Seal the value at key `name` of a chunk (chunk-file `header`, bytes `data`): its bytes encrypted, then the
        tag, into `out` (len(data) + VALUE_TAG_BYTES long); returns what the value starts with (VALUE_MAGIC, key id,
        nonce, header). One pass over the bytes (AES-GCM with AES-NI: GB/s), off the event loop."""
        nonce = self._aead.seal_into(data, self._value_aad(name, header), out)
        return VALUE_MAGIC + self.key_id + nonce + header

    def open_value_into(self, name: str, header: bytes | memoryview, nonce: bytes | memoryview,
                        sealed: bytes | memoryview, out: memoryview) -> bool:
        """Decrypt `sealed` (bytes then tag) of the value at `name` into `out` (exactly its length); False when the
        tag fails (forged, moved, damaged: `out` then holds noise, never the bytes of a forged value)."""
        return self._aead.open_into(nonce, sealed, self._value_aad(name, header), out)

    @staticmethod
    def _value_aad(name: str, header: bytes | memoryview) -> bytes:
        return b"value\0" + framed(name.encode()) + bytes(header)

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
        mac.update(framed(set_name.encode()))
        mac.update(member.encode())
        return mac.digest()[:ENTRY_TAG_BYTES].hex()


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
