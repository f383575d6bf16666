"""Who holds a store's pins: each pinned chunk's owners (the principals that took its pins) and how many each.

The eviction policy keeps the pins themselves (they nest, and a TTL expires a chunk's pins as a whole); this keeps
their owners beside them, so an unpin drops only the owner's own, and forgets them once the policy's pins are gone.
Owners are principals (`engine.<instance>`); "" (UNOWNED) owns the pins persisted before owners, or taken in
process.
`ChunkIndex` (shared/store_kit/chunk_index.py) pins and unpins through it.
"""

from __future__ import annotations

from kvmesh.shared.eviction.base import EvictionPolicy
from kvmesh.shared.wire.keys import ChunkKey

UNOWNED = ""  # the owner of pins taken without one (persisted before pins had owners, or in process)


class PinOwners:
    """pinned key -> owner -> pins it holds, over `policy`'s pins."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._owners: dict[ChunkKey, dict[str, int]] = {}

    def live(self, key: ChunkKey) -> dict[str, int]:
        """Who holds how many pins of `key` now (nothing once the policy dropped its pins: a TTL expired)."""
        owners = self._owners.get(key)
        if owners is None:
            return {}
        if not self._policy.is_pinned(key):
            del self._owners[key]
            return {}
        return owners

    def owned(self, key: ChunkKey) -> bool:
        """Whether an owner (not just unowned pins) pins `key` now."""
        return any(owner != UNOWNED for owner in self.live(key))

    def pin(self, key: ChunkKey, ttl_secs: float | None, owner: str) -> bool:
        """One more pin of `owner` on `key`; False if the policy took none (the key is not held)."""
        owners = self.live(key)  # first: stale owners of an expired pin go before it is re-taken
        if not self._policy.pin(key, ttl_secs):
            return False
        if not owners:
            owners = self._owners[key] = {}
        owners[owner] = owners.get(owner, 0) + 1
        return True

    def unpin(self, key: ChunkKey, owner: str) -> bool:
        """Drop one of `owner`'s pins on `key`; False if it holds none (another owner's pins are never touched)."""
        owners = self.live(key)
        if not owners.get(owner):
            return False
        owners[owner] -= 1
        if not owners[owner]:
            del owners[owner]
        if not owners:
            del self._owners[key]
        self._policy.unpin(key)
        return True

    def forget(self, key: ChunkKey) -> None:
        """`key` left the store: its owners go with it."""
        self._owners.pop(key, None)
