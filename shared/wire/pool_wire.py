"""How an engine lends its CPU pool (a sealed memfd, shared/wire/shm.py) to the disk store of its host: what both ends share.

The store listens on a Unix socket whose path both sides derive locally, never from a message:
`<runtime dir>/disk-stores/<store id>.sock`, in a directory that must be ours and private (0700; see
shared/messaging/credentials.py `private_dir`). An engine worker connects once per pool and sends one message: a small
JSON hello `{"caller": <its caller path>}` with the pool's descriptor attached (SCM_RIGHTS). Each side checks
the other's uid (SO_PEERCRED: the same user, or root). The store maps the descriptor if it is a sealed regular
file and answers `{"token": <random hex>, "size": <bytes>}` (or `{"error": ...}`); puts and gets then name
that token and an offset, and the store honours the token only on requests from the caller path that
registered it. The connection stays open: when it closes (the engine is gone) the store drops the mapping.
The store closes its end only after its last write into the pool (or by exiting), so an engine that sees the
store's end close (`Registration.store_gone` on its side) knows that store writes nothing more into the pool.

This module is what both sides share (the socket's path, the peer check, the messages); the engine's side
(`PoolLink`) is services/engine/tiers/pool_lending.py, the store's is services/disk_store/pools.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from pathlib import Path

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.credentials import private_dir, runtime_dir

SOCKET_DIR = "disk-stores"
REPLY_MAX_BYTES = 1024
_STORE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")  # usable as a file name as it is
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_path(store_id: str, scope: str = "") -> Path:
    """The pool socket of store `store_id` on this host, for the clients of the NATS server named `scope`
    (`bus.server_scope`: two meshes on one host, each with a store of the host's default id, never share a
    socket); its directory is made private first. ConfigError when the id cannot be a file name or the directory
    is not ours alone."""
    if not _STORE_ID.fullmatch(store_id) or (scope and not _STORE_ID.fullmatch(scope)):
        raise ConfigError(f"store id {store_id!r} cannot name a pool socket (letters, digits, '_', '.', '-')")
    return private_dir(runtime_dir() / SOCKET_DIR) / (f"{store_id}@{scope}.sock" if scope else f"{store_id}.sock")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (as it was at connect time)."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def trusted_uid(uid: int) -> bool:
    """Whom we share pools with: our own user, or root."""
    return uid in (os.getuid(), 0)


def encode_hello(caller: str) -> bytes:
    return json.dumps({"caller": caller}).encode()


def decode_hello(data: bytes) -> str:
    """The caller path of a hello; ValueError saying what is wrong."""
    try:
        hello = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the hello is not JSON ({exc})") from None
    caller = hello.get("caller") if isinstance(hello, dict) else None
    if not isinstance(caller, str) or not caller:
        raise ValueError("the hello names no caller")
    return caller


def encode_reply(token: str = "", size: int = 0, error: str = "") -> bytes:
    return json.dumps({"error": error} if error else {"token": token, "size": size}).encode()[:REPLY_MAX_BYTES]
