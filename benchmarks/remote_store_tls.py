"""The remote store's stream with TLS against the same stream in clear, measured in the same run; prints JSON.

Two remote store processes on one nats-server: one with a plaintext stream port, one with a TLS-only port
(`--stream-tls-cert`, a CA and certificate made here by shared/tls.py). This process is the engine-side client
(RemoteStoreClient, with `tls=` for the second). Rounds alternate clear and TLS (the machine's speed drifts), each
round puts then gets every chunk, and the figures are medians over the rounds. The ceiling is
benchmarks/remote_store.py's raw peer: the same bytes over a bare TCP loopback socket, measured between the rounds.
Every byte read back is compared with the source.

    python benchmarks/remote_store_tls.py --total-gib 0.5 --chunk-mib 16 --rounds 3

`ratio_put` / `ratio_get` are TLS throughput / clear throughput (the goal: >= 0.7). The TLS port runs the TLS
handshake, then carries the bytes in AES-256-GCM frames keyed inside it (shared/wire/tls_socket.py). Two
ceilings of one core, no socket involved, are printed too: the frames, the same chunks sealed and opened in
memory as the stream does (`frames_memory_seal_gbps`, `frames_memory_open_gbps`), and Python's TLS record layer,
the same chunks through a TLS session in memory (`tls_memory_encrypt_gbps`, `tls_memory_decrypt_gbps`): what the
stream was bound by when TLS carried the bytes too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from remote_store import MiB, GiB, RawClient, chunk_key  # benchmarks/remote_store.py: the raw ceiling

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent
from kvmesh.shared.tls import TlsFiles, TlsMaterial, client_context, server_context
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.tls_socket import FRAME_BYTES, LENGTH, NONCE, TAG_BYTES

CALLER = protocol.Principal.engine("bench").producer("bench")
RAW_PEER = str(Path(__file__).with_name("remote_store.py"))


async def run(args: argparse.Namespace) -> dict:
    chunk_bytes = int(args.chunk_mib * MiB)
    count = max(1, int(args.total_gib * GiB) // chunk_bytes)
    total = count * chunk_bytes
    source = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
    destination = np.zeros(total, dtype=np.uint8)
    chunks = [memoryview(source[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(count)]
    outs = [memoryview(destination[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(count)]
    checksums = [chunk_file.checksum(data) for data in chunks]  # computed once: the stream is what is timed

    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tls-") as tmp, EmbeddedNats() as nats_server:
        files = TlsMaterial(Path(tmp) / "tls").ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # room for every round's chunks: each round puts new keys
        size_gb = str(total * (args.rounds + 1) / GiB)
        stores = {
            kind: subprocess.Popen(
                [sys.executable, "-m", "kvmesh.services.remote_store", "--nats-url", nats_server.url,
                 "--max-size-gb", size_gb, "--store-id", f"bench-{kind}", "--stream-host", "127.0.0.1",
                 "--log-level", "WARNING",
                 *(["--stream-tls-cert", str(files.cert), "--stream-tls-key", str(files.key)] if kind == "tls" else [])],
                stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
            for kind in ("clear", "tls")}
        peer = subprocess.Popen(
            [sys.executable, RAW_PEER, "--raw-peer", "--nats-url", nats_server.url, "--chunk-mib", str(args.chunk_mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, preexec_fn=_die_with_parent)
        try:
            port = int(peer.stdout.readline())
            nc = await bus.connect(nats_server.url, "bench-client")
            clients = {"clear": RemoteStoreClient(nc, ["bench-clear"], CALLER, request_timeout=5.0),
                       "tls": RemoteStoreClient(nc, ["bench-tls"], CALLER, request_timeout=5.0,
                                                tls=client_context(files.ca))}
            for kind, client in clients.items():
                deadline = time.monotonic() + 60
                while not await client.stats():
                    if time.monotonic() > deadline or stores[kind].poll() is not None:
                        raise RuntimeError(f"the {kind} remote store did not come up")
                    await asyncio.sleep(0.1)
            raw = RawClient(port)
            await raw.connect()

            async def store_round(client: RemoteStoreClient, tag: int) -> tuple[float, float]:
                start = time.perf_counter()
                for i, data in enumerate(chunks):
                    meta = protocol.ChunkMeta(key=chunk_key(tag, i), num_tokens=256, shape=[chunk_bytes],
                                              dtype="uint8", fmt="bench", nbytes=chunk_bytes, checksum=checksums[i])
                    if not await client.put(meta, ChunkBuffer(data)):
                        raise RuntimeError(f"put {i} of round {tag} failed")
                put = time.perf_counter() - start
                destination.fill(1)
                start = time.perf_counter()
                for i, out in enumerate(outs):
                    if await client.get_into(chunk_key(tag, i), ChunkBuffer(out)) is None:
                        raise RuntimeError(f"get {i} of round {tag} missed")
                get = time.perf_counter() - start
                if not np.array_equal(destination, source):
                    raise RuntimeError(f"round {tag}: bytes read back differ from those written")
                return put, get

            times: dict[str, list[tuple[float, float]]] = {"clear": [], "tls": [], "raw": []}
            await raw.timed_round(chunks, outs)  # warm-up: connections, caches, the stores' first buffers
            for kind, client in clients.items():
                await store_round(client, 0)
            for tag in range(1, args.rounds + 1):
                for kind in ("clear", "tls", "raw") if tag % 2 else ("tls", "clear", "raw"):
                    times[kind].append(await raw.timed_round(chunks, outs) if kind == "raw" else
                                       await store_round(clients[kind], tag))
            version = None
            async with clients["tls"]._replicas[0].pool.connection(5.0) as connection:
                version = connection.sock.version()
            for client in clients.values():
                await client.close()
            await nc.close()
            ceiling = {**frames_memory_ceiling(chunks), **tls_memory_ceiling(files, chunks)}
        finally:
            if peer.poll() is None:
                peer.stdin.close()
            for process in stores.values():
                if process.poll() is None:
                    process.terminate()
            for process in (*stores.values(), peer):
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    gbps = lambda seconds: round(total / seconds / 1e9, 3)  # noqa: E731
    put = {kind: statistics.median(t[0] for t in rounds) for kind, rounds in times.items()}
    get = {kind: statistics.median(t[1] for t in rounds) for kind, rounds in times.items()}
    return {
        "benchmark": "remote_store_tls", "total_bytes": total, "chunk_bytes": chunk_bytes, "chunks": count,
        "rounds": args.rounds, "cpus": os.cpu_count(), "tls_version": version, "verified_bit_exact": True,
        "clear_put_gbps": gbps(put["clear"]), "tls_put_gbps": gbps(put["tls"]),
        "clear_get_gbps": gbps(get["clear"]), "tls_get_gbps": gbps(get["tls"]),
        "ratio_put": round(put["clear"] / put["tls"], 3), "ratio_get": round(get["clear"] / get["tls"], 3),
        "raw_tcp_put_gbps": gbps(put["raw"]), "raw_tcp_get_gbps": gbps(get["raw"]), **ceiling,
        "tls_put_gbps_rounds": [gbps(t[0]) for t in times["tls"]],
        "clear_put_gbps_rounds": [gbps(t[0]) for t in times["clear"]],
        "tls_get_gbps_rounds": [gbps(t[1]) for t in times["tls"]],
        "clear_get_gbps_rounds": [gbps(t[1]) for t in times["clear"]],
    }


def frames_memory_ceiling(chunks: list[memoryview]) -> dict:
    """Seal every chunk into frames of FRAME_BYTES and open them into a chunk-sized buffer, as tls_socket does (one
    AES-256-GCM key each way, counter nonces, the length as associated data)."""
    sealer = AESGCM(os.urandom(32))
    frame = memoryview(bytearray(FRAME_BYTES + TAG_BYTES))
    out = memoryview(bytearray(max(len(chunk) for chunk in chunks)))
    seal = open_ = 0.0
    counter = 0
    for chunk in chunks:
        for start in range(0, len(chunk), FRAME_BYTES):
            piece = chunk[start:start + FRAME_BYTES]
            nonce, aad = NONCE.pack(counter), LENGTH.pack(len(piece))
            counter += 1
            begin = time.perf_counter()
            sealer.encrypt_into(nonce, piece, aad, frame[:len(piece) + TAG_BYTES])
            middle = time.perf_counter()
            sealer.decrypt_into(nonce, frame[:len(piece) + TAG_BYTES], aad, out[start:start + len(piece)])
            open_ += time.perf_counter() - middle
            seal += middle - begin
        if not np.array_equal(np.frombuffer(out[:len(chunk)], np.uint8), np.frombuffer(chunk, np.uint8)):
            raise RuntimeError("a chunk opened differs from the one sealed")
    total = sum(len(chunk) for chunk in chunks)
    return {"frames_memory_seal_gbps": round(total / seal / 1e9, 3),
            "frames_memory_open_gbps": round(total / open_ / 1e9, 3), "frame_bytes": FRAME_BYTES}


def tls_memory_ceiling(files: TlsFiles, chunks: list[memoryview]) -> dict:
    """Encrypt and decrypt every chunk through a TLS session held in memory (client and server in this thread)."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_context(files.ca).wrap_bio(client_in, client_out, server_hostname="127.0.0.1")
    assert files.cert is not None and files.key is not None
    server = server_context(files.cert, files.key).wrap_bio(server_in, server_out, server_side=True)
    while True:  # the handshake, passing each side's bytes to the other
        done = 0
        for side in (client, server):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        server_in.write(client_out.read())
        client_in.write(server_out.read())
        if done == 2:
            break
    out = memoryview(bytearray(max(len(chunk) for chunk in chunks)))
    encrypt = decrypt = 0.0
    for chunk in chunks:
        start = time.perf_counter()
        client.write(chunk)
        sealed = client_out.read()
        middle = time.perf_counter()
        server_in.write(sealed)
        got = 0
        while got < len(chunk):
            got += server.read(len(chunk) - got, out[got:])
        decrypt += time.perf_counter() - middle
        encrypt += middle - start
    total = sum(len(chunk) for chunk in chunks)
    return {"tls_memory_encrypt_gbps": round(total / encrypt / 1e9, 3),
            "tls_memory_decrypt_gbps": round(total / decrypt / 1e9, 3), "tls_cipher": client.cipher()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-gib", type=float, default=0.5)
    parser.add_argument("--chunk-mib", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per kind (clear, TLS, raw)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
