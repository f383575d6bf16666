"""The remote tier on Redis / Valkey: `RedisTier`, a StoreTier whose bytes go engine <-> Redis directly.

Runs on the engine's NATS loop thread (all methods are coroutines), with a redis-py async client made from
`remote_url` (shared/wire/redis_url.py: standalone, TLS, unix socket, sentinel or cluster).

Keys (shared/wire/redis_keys.py): the value `<p>:chunk:{<h>}` is a chunk-file header and the chunk's bytes sealed
with AES-256-GCM (the format: redis_values.py); a value that is truncated, foreign (another key, another format
version) or fails its tag is a miss
with one (rate-limited) WARNING, is counted (`values_rejected` in stats) and deleted. A value under another key
id (engines with another secret on the prefix) is a miss too, counted (`values_foreign`) and left alone, so two
such groups never delete each other's values on reads; a put of ours replaces it. `<p>:owners:{<h>}` (entries of
the callers that put the chunk) and `<p>:claims:<caller>` let a `clear` take back only its caller's claims and
delete a chunk once nobody claims it; `<p>:pins:{<h>}` holds one entry per pin. A put is written to
`<p>:tmp:{<h>}:<n>` and moved into place by a script (redis_scripts.py), so no reader ever sees half a value.

Authentication (`RedisAuth`, keyed by `resolve_auth` in redis_values.py: `remote_auth_secret_file`, else the
sharing domain's secret in the engine's NATS credentials file): the bytes are encrypted on the engine, so Redis
holds ciphertext only, and the tag covers the value's key name, header and bytes, so a value written without the
secret, or moved from another key, is a miss. Pin and owner entries carry
a MAC too; the ones that fail it are ignored and removed (`entries_rejected`) whenever a pin, unpin or clear reads
the set, so an entry forged by a party without the secret never keeps a chunk unevictable or uncleared past an
honest unpin or clear. With no secret the keys derive from nothing secret (one WARNING at start): values are
then checked, not secret.

Eviction is Redis's own (`maxmemory` + `maxmemory-policy volatile-ttl`). Unpinned chunks carry a TTL
(`redis_chunk_ttl_secs`, refreshed by puts and hits, never shortened), which makes them volatile, i.e. evictable;
a pin removes the TTL (PERSIST), so no `volatile-*` policy evicts it; the last unpin puts the TTL back. A chunk
put with a request's kv_priority or lease gets more TTL than that, so that `volatile-ttl`, which evicts the
shortest TTL left first, keeps it over the others, within its engine principal's `retained_redis_share` of
`maxmemory` (redis_retention.py: the mapping and its limits). `start` checks `maxmemory-policy` (CONFIG GET,
where the server allows it) and warns when it is not `volatile-ttl` (leases and priorities are then not
honoured), and names what else goes wrong: pinned chunks evicted (`allkeys-*`), writes refused once full
(`noeviction`); redis_policy.py says which. A timed pin (`ttl_secs`) holds until unpinned.

Failures never fail a request: every call is bounded (`redis_timeout_secs`, plus `nbytes /
remote_min_transfer_mb_per_s` for a chunk's bytes) and answers a miss / False / 0 on any error. Reachability
changes are logged once each (StoreLink); after a failure Redis is not asked for `remote_retry_interval_secs`,
and the client reconnects by itself when it is back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from typing import Any, Awaitable, Callable, TypeVar

from redis.asyncio import RedisCluster
from redis.exceptions import ResponseError

from kvmesh.shared import protocol

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.tiers.base import NO_RETENTION, ChunkBuffer, Retention, StoreLink, byte_view
from kvmesh.services.engine.tiers.redis_policy import warn_of, warn_unreadable
from kvmesh.services.engine.tiers.redis_retention import extra_secs, member
from kvmesh.services.engine.tiers.redis_scripts import CLAIM, CLEAR, FINISH_PUT, PIN, RETAIN, UNPIN
from kvmesh.services.engine.tiers.redis_values import MAX_HEADER_BYTES, ForeignValue, decode_into
from kvmesh.shared.protocol.principals import principal_of
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES, ChunkKey
from kvmesh.shared.wire.redis_keys import SECRET_FILE_KEY, VALUE_MAGIC, VALUE_PREFIX_BYTES, VALUE_TAG_BYTES, RedisAuth, \
    RedisKeys
from kvmesh.shared.wire.redis_url import CLUSTER, RedisTarget

log = logging.getLogger(__name__)

T = TypeVar("T")

CLEAR_BATCH = 1000  # claims taken back per round trip of a clear
SEAL_BUFFERS_KEPT = 4  # sealing buffers kept between puts: the puts of one step in flight at once


class RedisTier:
    """StoreTier on Redis / Valkey for `caller` (an engine rank's path, as for our own stores: its puts are
    claimed by it, its `clear` takes back only them)."""

    location = protocol.REMOTE

    def __init__(self, target: RedisTarget, caller: str, *, key_prefix: str = "kvmesh", timeout: float = 2.0,
                 chunk_ttl: float = 604800.0, min_transfer_rate: float = 100e6, retry_interval: float = 1.0,
                 auth: RedisAuth | None = None, retained_share: float = 0.5) -> None:
        self.target = target
        self.caller = caller
        self.auth = auth if auth is not None else RedisAuth(None)
        self.values_rejected = 0  # values that were not a whole, authentic chunk of their key (deleted)
        self.values_foreign = 0  # values under another secret's key id (misses, left alone; a put replaces them)
        self._value_start = VALUE_MAGIC + self.auth.key_id  # what each value of ours starts with
        self.entries_rejected = 0  # pin and owner entries that failed their MAC (removed)
        self._seal_buffers: list[bytearray] = []  # kept for the next puts (`_seal_buffer`)
        self.store_ids = [protocol.redis_store_id(key_prefix)]
        self.keys = RedisKeys(key_prefix)
        self.timeout = timeout
        self.ttl_ms = int(chunk_ttl * 1000)
        # of maxmemory, what this engine principal's retained chunks may take (redis_retention.py); maxmemory is
        # read by `check_settings` (0 until then, or when unset: nothing is retained)
        self.retained_share = retained_share
        self.capacity_bytes = 0
        self.retained_key = self.keys.retained(principal_of(caller))
        self.retain_refused = 0  # retained puts written unretained: past the share, or maxmemory unknown
        self.policy: str | None = None  # maxmemory-policy, once read
        self.min_transfer_rate = min_transfer_rate
        self.client = target.client(timeout)
        self.link = StoreLink(self.store_ids[0], target.describe(), log, caller, retry_interval)
        self._tmp_ids = itertools.count()
        self._rlog = RateLimitedLog(log)  # one WARNING per bad value, not a flood when many are
        self._check: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, caller: str, auth: RedisAuth | None = None) -> "RedisTier":
        """The tier `config` describes; `auth` from `resolve_auth` (None: no secret)."""
        target = config.redis_target
        assert target is not None, "remote_url is no Redis URL"
        return cls(target, caller,
                   key_prefix=config.redis_key_prefix, timeout=config.redis_timeout_secs,
                   chunk_ttl=config.redis_chunk_ttl_secs,
                   min_transfer_rate=config.remote_min_transfer_mb_per_s * 1e6,
                   retry_interval=config.remote_retry_interval_secs, auth=auth,
                   retained_share=config.retained_redis_share)

    # ---- keys ------------------------------------------------------------------------------------------------
    def chunk_key(self, key: ChunkKey) -> str:
        return self.keys.chunk(key)

    def _keys(self, key: ChunkKey) -> list[str]:
        return self.keys.of_chunk(key)

    @property
    def claims_key(self) -> str:
        return self.keys.claims(self.caller)

    def _owner_entry(self, owners: str) -> str:
        return self.auth.entry(owners, self.caller)

    # ---- start-up check ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Loop thread: say whether values are authenticated; check the server's eviction settings in the
        background (serving does not wait)."""
        if self.auth.keyed:
            log.info("%s: values, pins and owners under %s:* authenticated with the secret of %s",
                     self.target.describe(), self.keys.prefix, self.auth.source)
        else:
            log.warning("%s: no secret to authenticate Redis values with (no %s, and the engine's NATS credentials "
                        "file records no sharing-domain secret): anyone who can write under %s:* can plant values "
                        "this engine loads; set %s (docs/config.md)", self.target.describe(), SECRET_FILE_KEY,
                        self.keys.prefix, SECRET_FILE_KEY)
        self._check = asyncio.get_running_loop().create_task(self.check_settings(), name="kvmesh-redis-check")

    async def check_settings(self) -> None:
        """Read the server's eviction settings once: maxmemory (INFO, which managed services allow; the bound of
        retention) and maxmemory-policy (CONFIG GET, where the server allows it), with one WARNING where they
        would hurt; never raises."""
        where = self.target.describe()
        memory = await self._memory()
        if memory is not None:
            self.capacity_bytes = memory[1]

        async def config() -> Any:
            try:
                return await self.client.config_get("maxmemory-policy")
            except ResponseError as exc:  # CONFIG disabled or renamed (managed services): not a failure of Redis
                log.debug("%s: CONFIG GET refused: %s", where, exc)
                return {}
        reply = await self._call("config check", config)
        if reply is None:
            return
        if not reply:
            warn_unreadable(log, where)
            return
        settings = {_text(k): _text(v) for k, v in reply.items()}
        self.policy = policy = settings.get("maxmemory-policy", "?")
        warn_of(log, where, policy, unbounded=memory is not None and memory[1] == 0)

    async def _memory(self) -> tuple[int, int] | None:
        """(used_memory, maxmemory) from INFO memory, summed over a cluster's nodes; None on a failure."""
        info = await self._call("stats", lambda: self.client.info("memory"))
        if not info:
            return None
        if self.target.mode == CLUSTER:  # one dict per node
            nodes = [v for v in info.values() if isinstance(v, dict)]
            return sum(int(v.get("used_memory", 0)) for v in nodes), sum(int(v.get("maxmemory", 0)) for v in nodes)
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    # ---- StoreTier: bytes ----------------------------------------------------------------------------------------
    async def put(self, meta: protocol.ChunkMeta, buffer: ChunkBuffer,
                  retention: Retention = NO_RETENTION) -> bool:
        data = byte_view(buffer.view)[: meta.nbytes]
        if len(data) != meta.nbytes or meta.checksum == 0:
            log.error("Redis put of %s: buffer holds %d bytes for %d, checksum %d: not stored", meta.key.hex(),
                      len(data), meta.nbytes, meta.checksum)
            return False
        chunk, _, owners = self._keys(meta.key)
        tmp = self.keys.tmp(meta.key, next(self._tmp_ids))
        ttl_ms = self.ttl_ms + await self._retained_ms(meta, retention)

        async def write() -> bool:
            held = await self.client.eval(CLAIM, 2, chunk, owners, self._owner_entry(owners), ttl_ms,
                                          self._value_start)
            if not held:
                # sealed under the final key's name, not tmp's; off the loop: it reads every byte of the chunk
                buffer = self._seal_buffer(len(data) + VALUE_TAG_BYTES)
                try:
                    sealed = memoryview(buffer)[:len(data) + VALUE_TAG_BYTES]
                    head = await asyncio.to_thread(self.auth.seal_value, chunk, chunk_file.encode_header(meta),
                                                   data, sealed)
                    await self._write_value(tmp, head, sealed, ttl_ms)
                finally:
                    self._return_seal_buffer(buffer)
                await self.client.eval(FINISH_PUT, 2, tmp, chunk, self._value_start)
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.claims_key, meta.key.hex(), meta.num_tokens)
            pipe.pexpire(self.claims_key, ttl_ms, nx=True)  # a new claims hash
            pipe.pexpire(self.claims_key, ttl_ms, gt=True)  # as long as its longest-lived chunk
            await pipe.execute()
            return True

        ok = await self._call("put", write, meta.nbytes)
        if ok:
            self.link.accepted()
        return bool(ok)

    async def _retained_ms(self, meta: protocol.ChunkMeta, retention: Retention) -> int:
        """The TTL a put's retention adds over the base (redis_retention.py), once its principal's share took it
        (RETAIN); 0 when there is none or it is past the share (counted in `retain_refused`)."""
        now = time.time()
        extra = extra_secs(retention, now)
        if extra <= 0 or self.link.resting:  # resting: the put is skipped anyway, not refused a retention
            return 0
        bound = int(self.retained_share * self.capacity_bytes)
        now_ms, extra_ms = int(now * 1000), int(extra * 1000)
        taken = bound > 0 and await self._call("retain", lambda: self.client.eval(
            RETAIN, 1, self.retained_key, now_ms, member(meta.key.hex(), meta.nbytes), now_ms + extra_ms,
            meta.nbytes, bound))
        if not taken:
            self.retain_refused += 1
            return 0
        return extra_ms

    def _seal_buffer(self, nbytes: int) -> bytearray:
        """A buffer of at least `nbytes` to seal a value into: a kept one, else a new one. Kept because a fresh
        32 MiB buffer pays a page fault per 4 KiB on every put (0.4 GB/s here, against GB/s for the sealing)."""
        while self._seal_buffers:
            buffer = self._seal_buffers.pop()
            if len(buffer) >= nbytes:
                return buffer
        return bytearray(nbytes)

    def _return_seal_buffer(self, buffer: bytearray) -> None:
        if len(self._seal_buffers) < SEAL_BUFFERS_KEPT:
            self._seal_buffers.append(buffer)

    async def _write_value(self, name: str, header: bytes, data: memoryview, ttl_ms: int) -> None:
        """SET `name` to header + data with `ttl_ms`, without joining them into one 32 MiB buffer.

        redis-py's SET takes one buffer; joining costs a copy of the chunk (here, or in Redis with SET + APPEND:
        0.75x the speed of a bare SET on the benchmark). So for one server (standalone, sentinel) the command
        is packed here and its parts written as they are; a cluster, where redis-py routes each key, gets SET of
        the header then APPEND of the bytes.
        """
        if isinstance(self.client, RedisCluster):
            pipe = self.client.pipeline(transaction=False)
            pipe.set(name, header, px=ttl_ms)
            pipe.append(name, data)
            await pipe.execute()
            return
        key, ttl = name.encode(), str(ttl_ms).encode()
        head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(header) + len(data))
        tail = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
        pool = self.client.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command([head, header, data, tail])
            await connection.read_response()  # OK, or raises the error reply
        except BaseException:
            await connection.disconnect()  # cut short mid-command: the connection's protocol state is lost
            raise
        finally:
            await pool.release(connection)

    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> protocol.ChunkMeta | None:
        view = byte_view(buffer.view)
        # GETRANGE, not GET: a value larger than a chunk could be (someone else's) never costs more memory than
        # the slot plus a header; it arrives cut short and fails the length check
        last = len(view) + VALUE_PREFIX_BYTES + MAX_HEADER_BYTES + VALUE_TAG_BYTES - 1
        name = self.chunk_key(key)
        value = await self._call("get", lambda: self.client.getrange(name, 0, last), len(view))
        if not value:  # b"": no such key
            return None
        try:  # decryption off the loop: 32 MiB would stall every other request on it
            return await asyncio.to_thread(decode_into, self.auth, name, key, value, view)
        except ForeignValue as exc:
            self.values_foreign += 1
            self._rlog.warning("foreign", "%s: %s; a miss. Instances that should share values need one secret "
                               "(%s, or credentials of one sharing domain); others, their own redis_key_prefix",
                               self.target.describe(), exc, SECRET_FILE_KEY)
            return None
        except chunk_file.CorruptChunkFile as exc:  # tag, bad header, another key, truncated
            self.values_rejected += 1
            self._rlog.warning("corrupt", "%s: %s; treated as a miss and deleted", self.target.describe(), exc)
            await self._call("delete corrupt", lambda: self.client.delete(*self._keys(key)))
            return None

    # ---- StoreTier: control ------------------------------------------------------------------------------------
    async def contains(self, keys: list[ChunkKey]) -> int:
        if not keys:
            return 0
        held = await self._pipelined("contains", [("exists", (self.chunk_key(k),)) for k in keys])
        return _prefix(held or [])

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        """Pin the held prefix (pins past the first chunk not held are taken back); tokens pinned."""
        if not keys:
            return 0
        entries = [self.auth.entry(self._keys(k)[1], secrets.token_hex(8)) for k in keys]
        done = await self._pipelined("pin", [("eval", (PIN, 3, *self._keys(k), entry))
                                             for k, entry in zip(keys, entries)]) or []
        prefix = _prefix(done)
        extras = [(k, entry) for k, entry, ok in list(zip(keys, entries, done))[prefix:] if ok]
        if extras:  # exactly the pins just made
            await self._pipelined("unpin", [("eval", (UNPIN, 3, *self._keys(k), self.ttl_ms, entry, 0))
                                            for k, entry in extras])
        return sum(num_tokens[:prefix])

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        """Take back one authentic pin of each chunk (any caller's: pins are counted, as at our stores); a chunk
        held only by pins that fail their MAC is made volatile again, and counts no tokens."""
        if not keys:
            return 0
        sets = await self._entries("unpin", keys)
        if sets is None:
            return 0
        ops = []
        for key, (good_pins, bad_pins, _, bad_owners) in zip(keys, sets):
            # a random one of the good pins: two unpins at once seldom pick the same
            entry = secrets.choice(good_pins) if good_pins else ""
            ops.append(("eval", (UNPIN, 3, *self._keys(key), self.ttl_ms, entry, len(bad_pins), *bad_pins,
                                 *bad_owners)))
        done = await self._pipelined("unpin", ops)
        return sum(n for n, ok in zip(num_tokens, done or []) if ok)

    async def _entries(self, what: str, keys: list[ChunkKey]) -> list[tuple[list[bytes], ...]] | None:
        """Per chunk, its pin and owner entries, sorted: (good pins, bad pins, good owners, bad owners); bad ones
        (failing their MAC: forged, moved from another chunk, an older format) are counted and logged."""
        ops: list[tuple[str, tuple[Any, ...]]] = []
        for key in keys:
            _, pins, owners = self._keys(key)
            ops += [("smembers", (pins,)), ("smembers", (owners,))]
        replies = await self._pipelined(what, ops, raise_on_error=False)  # a key of the wrong type is no failure
        if replies is None:
            return None
        result = []
        for i, key in enumerate(keys):
            _, pins, owners = self._keys(key)
            sorted_sets: list[list[bytes]] = []
            for name, members in ((pins, replies[2 * i]), (owners, replies[2 * i + 1])):
                members = members if isinstance(members, (set, list)) else []  # WRONGTYPE: the scripts drop it
                good = [m for m in members if self.auth.entry_ok(name, m)]
                sorted_sets += [good, [m for m in members if m not in good]]
            bad = len(sorted_sets[1]) + len(sorted_sets[3])
            if bad:
                self.entries_rejected += bad
                self._rlog.warning("bad entry", "%s: chunk %s: %d pin or owner entries fail their MAC (written "
                                   "without the secret, or by an older KVMesh); ignored and removed",
                                   self.target.describe(), key.hex(), bad)
            result.append(tuple(sorted_sets))
        return result

    async def touch(self, keys: list[ChunkKey]) -> None:
        """A hit: refresh the chunks' LRU clock, and the TTL of the unpinned ones (GT: only keys that expire, and
        never shorter: a retained chunk keeps its extra)."""
        ops: list[tuple[str, tuple[Any, ...]]] = []
        for key in keys:
            chunk, _, owners = self._keys(key)
            ops += [("touch", (chunk,)), ("pexpire", (chunk, self.ttl_ms, False, False, True)),
                    ("pexpire", (owners, self.ttl_ms, False, False, True))]
        if ops:
            await self._pipelined("touch", ops)

    async def remove(self, keys: list[ChunkKey]) -> int:
        if not keys:
            return 0
        done = await self._pipelined("remove", [("delete", tuple(self._keys(k))) for k in keys])
        return sum(1 for n in done or [] if n)

    async def clear(self) -> int:
        """Take back this caller's claims; the tokens of the chunks whose claim it took back (as our stores).

        In batches of `CLEAR_BATCH` claims, each bounded like any call: a long claim list never needs one long
        wait, and a clear cut short by a failure leaves the rest claimed for the next clear."""
        tokens, cursor = 0, 0
        while True:
            page = await self._call("clear", lambda: self.client.hscan(self.claims_key, cursor, count=CLEAR_BATCH))
            if page is None:
                return tokens
            cursor, claims = page
            entries = [(h, *_claim(h, n)) for h, n in claims.items()]
            held = [(key, n) for _, key, n in entries if key is not None]
            if held:
                sets = await self._entries("clear", [key for key, _ in held])
                if sets is None:
                    return tokens
                ops = []
                for (key, _), (_, bad_pins, _, bad_owners) in zip(held, sets):
                    chunk, pins, owners = self._keys(key)
                    ops.append(("eval", (CLEAR, 3, chunk, pins, owners, self.ttl_ms, self._owner_entry(owners),
                                         len(bad_owners), *bad_owners, *bad_pins)))
                done = await self._pipelined("clear", ops)
                if done is None:
                    return tokens
                tokens += sum(n for (_, n), ok in zip(held, done) if ok)
            if entries:
                await self._call("clear", lambda: self.client.hdel(self.claims_key, *[h for h, _, _ in entries]))
            if cursor == 0:
                return tokens

    async def stats(self) -> list[protocol.StatsReply]:
        """The server's memory use and maxmemory (num_chunks is not counted here: that would take a SCAN)."""
        memory = await self._memory()
        if memory is None:
            return []
        used, self.capacity_bytes = memory
        return [protocol.StatsReply(self.store_ids[0], num_chunks=0, used_bytes=used, capacity_bytes=memory[1],
                                    details={"target": self.target.describe(), "authenticated": self.auth.keyed,
                                             "values_rejected": self.values_rejected,
                                             "values_foreign": self.values_foreign,
                                             "entries_rejected": self.entries_rejected,
                                             "maxmemory_policy": self.policy,
                                             "retain_refused": self.retain_refused})]

    async def close(self) -> None:
        if self._check is not None:
            self._check.cancel()
        try:
            await self.client.aclose()
        except Exception as exc:  # closing a client of a dead server
            log.debug("closing the Redis client: %s", exc)

    # ---- plumbing ------------------------------------------------------------------------------------------------
    async def _call(self, what: str, op: Callable[[], Awaitable[T]], nbytes: int = 0) -> T | None:
        """`op()` within the bound (timeout plus the bytes at the minimum rate); None on any failure."""
        if self.link.resting:
            return None
        limit = self.timeout + nbytes / self.min_transfer_rate
        try:
            async with asyncio.timeout(limit):
                result = await op()
        except TimeoutError:
            self.link.failed(f"{what}: no answer within {limit:.1f}s")
            return None
        except Exception as exc:  # connection refused or reset, an error reply (OOM under noeviction, ...)
            if _is_refusal(exc):
                self.link.refused(f"{what}: {exc}")
            else:
                self.link.failed(f"{what}: {type(exc).__name__}: {exc}")
            return None
        self.link.answered()
        return result

    async def _pipelined(self, what: str, ops: list[tuple[str, tuple[Any, ...]]],
                         raise_on_error: bool = True) -> list[Any] | None:
        """One round trip for many commands (routed per key on a cluster); their replies, or None. Without
        `raise_on_error`, a command's error reply is its reply (an exception object) instead of a failure."""
        async def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name, args in ops:
                getattr(pipe, name)(*args)
            return await pipe.execute(raise_on_error=raise_on_error)
        return await self._call(what, run)


def _claim(field: bytes, tokens: bytes) -> tuple[ChunkKey | None, int]:
    """A claims-hash entry (chunk hex -> tokens) as (chunk key, tokens); (None, 0) for one that is not ours."""
    try:
        key, n = bytes.fromhex(_text(field)), int(tokens)
    except ValueError:
        return None, 0
    return (key, n) if len(key) == KEY_BYTES else (None, 0)


def _prefix(flags: list[Any]) -> int:
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def _is_refusal(exc: Exception) -> bool:
    """An error reply saying the server is full (noeviction), not that it is gone."""
    return isinstance(exc, ResponseError) and str(exc).startswith("OOM")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
