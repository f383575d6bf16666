"""Whether a store answers a caller, as the store tests probe it (a store serves each principal of its domains
map on a lane of its own, once it has read the map)."""

from __future__ import annotations

import os
from typing import Any

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from support.waiting import WAIT_S


async def answered(nc: Any, store_id: str, caller: str) -> bool:
    """Whether `store_id` answers a contains from `caller` (False: no responder, no reply)."""
    try:
        reply = await bus.request(nc, protocol.Subjects.store(store_id, "contains", caller),
                                  protocol.ChunkKeys(keys=[os.urandom(16)]), protocol.ContainsReply, WAIT_S)
    except Exception:
        return False
    return reply.prefix == 0
