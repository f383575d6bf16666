"""The names of KVMesh's keys in Redis / Valkey, for the engine's tier and the service that reports them.

`<p>` is `redis_key_prefix`, `<h>` a chunk key in hex (which already encodes the model and the KV format). The
braces are a cluster hash tag: one chunk's keys live on one shard, so one script can touch them all.
  * `<p>:chunk:{<h>}`        the value (chunk-file header, then the bytes)
  * `<p>:pins:{<h>}`         pin count (absent: not pinned)
  * `<p>:owners:{<h>}`       set of the callers that put the chunk
  * `<p>:tmp:{<h>}:<n>`      a put being written
  * `<p>:claims:<caller>`    hash chunk hex -> tokens, what one caller put
"""

from __future__ import annotations

from kvmesh.shared.keys import KEY_BYTES, ChunkKey


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
