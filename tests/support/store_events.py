"""What a store tells the controller, as a test hears it."""

from __future__ import annotations

from typing import Any

from kvmesh.shared import protocol
from kvmesh.shared.errors import ProtocolError


async def admission_batches(nc: Any, store_id: str) -> list[protocol.AdmissionBatch]:
    """Every AdmissionBatch `store_id` publishes from now on (its full syncs left out), appended as they arrive."""
    batches: list[protocol.AdmissionBatch] = []

    async def on_event(msg: Any) -> None:
        try:
            batches.append(protocol.decode(msg.data, protocol.AdmissionBatch))
        except ProtocolError:
            pass  # a SyncChunk

    await nc.subscribe(protocol.Subjects.events(protocol.store_path(store_id)), cb=on_event)
    return batches
