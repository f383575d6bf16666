"""AES-256-GCM sealing: the one construction behind what KVMesh encrypts at rest, Redis values
(shared/wire/redis_keys.py) and the chunks an engine puts in the disk store and the remote store
(services/engine/tiers/sealed.py).

Keys derive from a secret by HMAC-SHA256 with a label per use (`derive`), so one secret never keys two things
directly. Each user stores a key id beside its values (KEY_ID_BYTES of a digest of its keys: it tells nothing of
them), so a reader tells "sealed under another key" (another sharing domain, a rotated secret) from "forged or
damaged". Nonces are 12
random bytes per seal: far below the 2^32 seals per key that random GCM nonces allow. Sealing and opening read
and write caller buffers (`encrypt_into` / `decrypt_into`): one pass over the bytes, no copy beside it.
"""

from __future__ import annotations

import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16  # after the ciphertext
_LENGTH = struct.Struct("<Q")


def derive(secret: bytes, label: bytes) -> bytes:
    """A 32-byte key for the use `label` names, from `secret` (b"": keyed by nothing secret)."""
    return hmac.digest(secret, label, "sha256")


def framed(part: bytes) -> bytes:
    """`part` prefixed by its length: associated data made of several parts cannot be re-cut into others."""
    return _LENGTH.pack(len(part)) + part


class Aead:
    """AES-256-GCM under one key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal_into(self, data: bytes | memoryview, aad: bytes, out: memoryview) -> bytes:
        """Encrypt `data` then append the tag into `out` (len(data) + TAG_BYTES long); the nonce used."""
        nonce = os.urandom(NONCE_BYTES)
        self._aead.encrypt_into(nonce, data, aad, out)
        return nonce

    def open_into(self, nonce: bytes | memoryview, sealed: bytes | memoryview, aad: bytes, out: memoryview) -> bool:
        """Decrypt `sealed` (ciphertext then tag) into `out` (exactly the ciphertext's length); False when the tag
        fails (`out` then holds noise, never the bytes of a forged value)."""
        try:
            self._aead.decrypt_into(bytes(nonce), sealed, aad, out)
        except InvalidTag:
            return False
        return True
