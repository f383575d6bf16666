"""Bounds a NATS client can push on at a chunk store, the same for the disk store and the remote store.

`StoreBounds` is one set of them; its fields declare their command-line flags (shared/options_cli.py), which both
stores' options take in through `group(StoreBounds)` (docs/config.md lists them per store,
docs/security.md says what each guards against):

    --max-keys-per-request  keys in one contains / touch / pin / unpin / remove request; more: an error reply
    --max-inline-bytes      bytes of one put's inline `data`; more: an error reply (bulk bytes go by shared
                            memory or the remote store's stream)
    --request-queue-mb      bytes of requests queued per op subscription; past it nats-py drops what arrives
                            (counted: `requests_dropped`) instead of the store's memory growing (it was 1 GiB
                            per op). This does not make nats-py read faster: publishers faster than the store's
                            reader (~0.1-0.4 GB/s) still get a connection cut off by nats-server as a slow
                            consumer once 64 MiB wait for it there; it reconnects. Each engine principal the
                            domains map lists is served on a connection of its own (a lane), so what one principal
                            floods, puts or 40 MiB of garbage on any op, cuts off its own lane only
                            (shared/store_kit/store_endpoint.py, StoreEndpoint); the queue bound applies per lane. A lower
                            --max-inline-bytes does not help: the server delivers a put whole before the store can
                            refuse it, and a flood of 8 MiB puts got the store cut off more often than one of 40 MiB
    --max-lanes             engine principals served on a connection of their own (each one TCP connection and
                            one subscription per op); those past it share one overflow connection, where one's
                            flood can cut off the others
    --min-sync-interval     seconds between two full syncs the store publishes (shared/messaging/admissions.py)
    --retained-share        share of the store's size one engine principal's chunks put with a priority or a lease
                            (a request's kv_transfer_params) may keep over the rest (`ChunkIndex.retain_put`)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.options_cli import option

MiB = 1024 * 1024


@dataclass(frozen=True)
class StoreBounds:
    # a 1M-token prompt in chunks of 16 tokens is 62,500 keys
    max_keys_per_request: int = option(
        "--max-keys-per-request",
        "most keys in one contains / touch / pin / unpin / remove request; more get an error", 100_000)
    # NATS discourages payloads over 8 MB; measured here, a flood of 20 MB inline puts from another process got a
    # store cut off by nats-server as a slow consumer (its 64 MiB max_pending), one of 8 MB did not
    max_inline_bytes: int = option("--max-inline-bytes",
                                   "largest inline `data` of one put; a larger put gets an error", 8 * MiB)
    # nats-py's own default per subscription (ours was 1 GiB)
    request_queue_bytes: int = option(
        "--request-queue-mb", "requests queued per NATS subscription, in MiB; past it new ones are dropped and "
        "counted (requests_dropped)", 128 * MiB, scale=MiB)
    min_sync_interval: float = option(
        "--min-sync-interval", "seconds between two full syncs; requests within it are served when it ends", 1.0)
    retained_share: float = option(
        "--retained-share", "share of the store's size (0 to 1) one engine principal's chunks put with a "
        "kv_priority or a lease may keep over the rest; past it a chunk is held as any other", 0.5)
    max_lanes: int = option(
        "--max-lanes", "engine principals of the domains map served on a NATS connection of their own (so one's "
        "flood cuts off only its own); those past it share one (0: all share one)", 64)

    def check(self) -> None:
        """Raise ConfigError naming the flag of a bound that makes no sense."""
        for flag, value in (("--max-keys-per-request", self.max_keys_per_request),
                            ("--max-inline-bytes", self.max_inline_bytes),
                            ("--request-queue-mb", self.request_queue_bytes)):
            if value <= 0:
                raise ConfigError(f"{flag}: must be > 0, got {value}")
        if self.max_inline_bytes >= self.request_queue_bytes:  # such a put would always be dropped unread
            raise ConfigError(f"--max-inline-bytes {self.max_inline_bytes} must be below --request-queue-mb "
                              f"({self.request_queue_bytes} bytes)")
        if self.max_lanes < 0:
            raise ConfigError(f"--max-lanes: must be >= 0, got {self.max_lanes}")
        if not 0 <= self.retained_share <= 1:  # also NaN
            raise ConfigError(f"--retained-share: must be between 0 and 1, got {self.retained_share}")
        if self.min_sync_interval < 0:
            raise ConfigError(f"--min-sync-interval: must be >= 0, got {self.min_sync_interval}")

    def too_many_keys(self, count: int) -> str | None:
        """The error for a request naming `count` keys, or None if that is within the bound."""
        if count <= self.max_keys_per_request:
            return None
        return (f"{count} keys in one request; this store takes at most {self.max_keys_per_request} "
                "(--max-keys-per-request): split the request")

    def inline_too_large(self, nbytes: int) -> str | None:
        """The error for a put with `nbytes` of inline data, or None if that is within the bound."""
        if nbytes <= self.max_inline_bytes:
            return None
        return (f"inline put of {nbytes} bytes; this store takes at most {self.max_inline_bytes} inline "
                "(--max-inline-bytes): send the bytes by shared memory or the remote store's stream")
