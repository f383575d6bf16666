"""The worker's end of the scheduler's lower-tier lookups: `LookupServer` answers `PrefixLookup` on the
worker's lookup subject (scheduler side: adapter/scheduler_lookup.py)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine
    from kvmesh.services.engine.mesh.nats_loop import NatsLoop

log = logging.getLogger(__name__)


def lookup_id_for(worker_id: str) -> str:
    """This worker process's lookup address: the worker id plus the pid, so two vLLM instances with the same
    instance id on one NATS (e.g. two disk-offload servers sharing a host's embedded mesh) never answer each
    other's lookups."""
    return f"{worker_id}-p{os.getpid()}"


class LookupServer:
    """Answers `PrefixLookup` on the worker's lookup subject, on the engine's NATS loop (no thread hop)."""

    def __init__(self, engine: "CacheEngine", nats_loop: "NatsLoop", lookup_id: str) -> None:
        self.engine = engine
        self.nats_loop = nats_loop
        self.subject = protocol.Subjects.worker(engine.config.lmcache_instance_id, lookup_id, protocol.PREFIX_LOOKUP_OP)
        self._subscription: Any = None
        nats_loop.on_connected(self._serve)

    async def _serve(self, nc: Any) -> None:
        self._subscription = await bus.serve(nc, self.subject, protocol.PrefixLookup, self._handle)
        log.info("answering prefix lookups on %s", self.subject)

    async def _handle(self, request: protocol.PrefixLookup) -> protocol.CommandReply:
        try:
            spans = self.engine.chunk_spans(request.keys, request.num_tokens, state=request.state)
            tiers = frozenset(request.tiers) if request.tiers is not None else None
            held = await self.engine.lookup_and_prefetch(spans, request.peer_instance, request.peer_worker,
                                                         request.prefetch_from, tiers)
            return protocol.CommandReply(ok=True, num_tokens=held)
        except Exception as exc:  # a broken lookup is a miss, never a failed request
            log.warning("prefix lookup failed (%s: %s); answering a miss", type(exc).__name__, exc)
            return protocol.CommandReply(ok=False, error=f"{type(exc).__name__}: {exc}")
