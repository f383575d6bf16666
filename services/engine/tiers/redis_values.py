"""The Redis tier's values (redis.py): how a stored value is checked and read back, and the key that MACs them.

The value `<p>:chunk:{<h>}` is VALUE_MAGIC, the MAC key's id, a MAC, then the chunk-file header
(shared/wire/chunk_file.py: ChunkMeta, data checksum, the header's own check) and the bytes. The MAC covers the value's
key name, header and bytes, so a value written without the secret, or moved from another key, fails it
(`CorruptValue`); a value under another key id is another secret's (`ForeignValue`).
"""

from __future__ import annotations

import hmac
import io
from pathlib import Path

from kvmesh.shared import protocol

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.shared.messaging.credentials import sharing_domain
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.redis_keys import KEY_ID_BYTES, SECRET_FILE_KEY, VALUE_MAGIC, VALUE_PREFIX_BYTES, RedisAuth, \
    read_secret_file

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
    """Check a stored value (MAC, header, key, length, checksum) and copy its bytes into `out`; its meta."""
    if value[: len(VALUE_MAGIC)] != VALUE_MAGIC:
        raise CorruptValue(f"value of chunk {key.hex()}: not a KVMesh Redis value of this version (no MAC: "
                           "written by an older KVMesh, or not by KVMesh)")
    key_id_end = len(VALUE_MAGIC) + KEY_ID_BYTES
    if len(value) >= key_id_end and value[len(VALUE_MAGIC): key_id_end] != auth.key_id:
        raise ForeignValue(f"value of chunk {key.hex()} is MAC'd under another secret")
    body = memoryview(value)[VALUE_PREFIX_BYTES:]
    if not hmac.compare_digest(auth.value_tag(name, b"", body), value[key_id_end: VALUE_PREFIX_BYTES]):
        raise CorruptValue(f"value of chunk {key.hex()}: MAC mismatch (written without this engine's secret, "
                           "moved from another key, truncated or damaged)")
    stream = io.BytesIO(body)
    stream.name = f"value of chunk {key.hex()}"  # type: ignore[misc]  # read_header names the source by it
    meta, offset = chunk_file.read_header(stream)
    if meta.key != key:
        raise CorruptValue(f"value of chunk {key.hex()} holds chunk {meta.key.hex()!s:.32}")
    if len(body) != offset + meta.nbytes:
        raise CorruptValue(f"value of chunk {key.hex()}: {len(body)} bytes, expected {offset + meta.nbytes} "
                           "(truncated or padded)")
    if len(out) < meta.nbytes:
        raise CorruptValue(f"chunk {key.hex()}: {meta.nbytes} bytes do not fit a buffer of {len(out)}")
    data = body[offset:]
    if chunk_file.checksum(data) != meta.checksum:
        raise CorruptValue(f"value of chunk {key.hex()}: checksum mismatch")
    out[: meta.nbytes] = data
    return meta

