"""The Redis tier's values (redis.py): how a stored value is checked and read back, and the keys that seal them.

The value `<p>:chunk:{<h>}` is VALUE_MAGIC, the keys' id, a nonce, the chunk-file header (shared/wire/chunk_file.py:
ChunkMeta, data checksum, the header's own check), then the bytes sealed with AES-256-GCM and its tag
(shared/wire/redis_keys.py). The tag covers the value's key name, header and bytes, so a value written without the
secret, or moved from another key, fails it (`CorruptValue`); a value under another key id is another secret's
(`ForeignValue`).
"""

from __future__ import annotations

import io
from pathlib import Path

from kvmesh.shared import protocol

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.shared.messaging.credentials import sharing_domain
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.redis_keys import KEY_ID_BYTES, NONCE_BYTES, SECRET_FILE_KEY, VALUE_MAGIC, VALUE_PREFIX_BYTES, \
    VALUE_TAG_BYTES, RedisAuth, read_secret_file

MAX_HEADER_BYTES = 64 * 1024  # a chunk-file header is one DATA_ALIGN page; more is not a value of ours


class CorruptValue(chunk_file.CorruptChunkFile):
    """A Redis value that is not a whole, verified chunk of the asked key."""


class ForeignValue(Exception):
    """A Redis value MAC'd under another key (engines with another secret on the same prefix): not ours to load,
    nor to delete."""


def resolve_auth(config: EngineConfig, credentials: str | Path | None) -> RedisAuth:
    """The Redis tier's MAC key: `remote_auth_secret_file`, else the sharing domain's secret in the engine's NATS
    `credentials` file (`engine_credentials_file` in services/engine/mesh/domain.py), else none. ConfigError naming
    the file when one is unreadable."""
    if config.remote_auth_secret_file:
        return RedisAuth(read_secret_file(config.remote_auth_secret_file),
                         f"{SECRET_FILE_KEY} {config.remote_auth_secret_file}")
    domain = sharing_domain(credentials)
    if domain.secret is None:
        return RedisAuth(None)
    return RedisAuth(domain.secret, f"sharing domain {domain.name} ({credentials})")


def decode_into(auth: RedisAuth, name: str, key: ChunkKey, value: bytes, out: memoryview) -> protocol.ChunkMeta:
    """Check a stored value (key id, header, key, length, tag) and decrypt its bytes into `out`; its meta. One pass
    over the bytes: the tag authenticates them, so the header's checksum is not computed again."""
    if value[: len(VALUE_MAGIC)] != VALUE_MAGIC:
        raise CorruptValue(f"value of chunk {key.hex()}: not a KVMesh Redis value of this version (not sealed: "
                           "written by an older KVMesh, or not by KVMesh)")
    key_id_end = len(VALUE_MAGIC) + KEY_ID_BYTES
    if len(value) >= key_id_end and value[len(VALUE_MAGIC): key_id_end] != auth.key_id:
        raise ForeignValue(f"value of chunk {key.hex()} is sealed under another secret")
    if len(value) < VALUE_PREFIX_BYTES + VALUE_TAG_BYTES:
        raise CorruptValue(f"value of chunk {key.hex()}: {len(value)} bytes, too short for a value")
    nonce = memoryview(value)[key_id_end: key_id_end + NONCE_BYTES]
    body = memoryview(value)[VALUE_PREFIX_BYTES:]
    stream = io.BytesIO(body)
    stream.name = f"value of chunk {key.hex()}"  # type: ignore[misc]  # read_header names the source by it
    meta, offset = chunk_file.read_header(stream)
    if meta.key != key:
        raise CorruptValue(f"value of chunk {key.hex()} holds chunk {meta.key.hex()!s:.32}")
    if len(body) != offset + meta.nbytes + VALUE_TAG_BYTES:
        raise CorruptValue(f"value of chunk {key.hex()}: {len(body)} bytes after its prefix, expected "
                           f"{offset + meta.nbytes + VALUE_TAG_BYTES} (truncated or padded)")
    if len(out) < meta.nbytes:
        raise CorruptValue(f"chunk {key.hex()}: {meta.nbytes} bytes do not fit a buffer of {len(out)}")
    if not auth.open_value_into(name, body[:offset], nonce, body[offset:], out[: meta.nbytes]):
        raise CorruptValue(f"value of chunk {key.hex()}: tag mismatch (sealed without this engine's secret, "
                           "moved from another key, truncated or damaged)")
    return meta
