"""A real redis-server for tests and benchmarks: Debian's /usr/bin/redis-server on a free loopback port, its
files in a temporary directory, no persistence (`--save '' --appendonly no`), always stopped.

`kill()` then `start()` again brings it back on the same port (a restart the tier must survive).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis

from support.waiting import WAIT_S, wait_until

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process; `extra` are more `--name value` arguments (e.g. maxmemory settings)."""

    def __init__(self, *extra: str) -> None:
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-redis-"))
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--logfile", str(self.dir / "redis.log"), *self.extra]

    def start(self) -> "RedisServer":
        argv = self.argv()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        wait_until(self._answers, WAIT_S, what=f"redis-server on port {self.port}", interval=0.05)
        return self

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                               f"{(self.dir / 'redis.log').read_text(errors='replace')[-2000:]}")
        try:
            with self.client() as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False

    def client(self) -> redis.Redis:
        """A blocking client, for a test to look at (or tamper with) what the tier wrote."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=WAIT_S)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing (a hung or overloaded Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # also ends a paused one
            self.proc.wait(WAIT_S)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class _StartedTogether:
    """A context manager over `start()` / `stop()` of several servers: a start that fails stops what it started."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *_: object) -> None:
        self.stop()


class RedisClusterServers(_StartedTogether):
    """A Redis Cluster of `primaries` redis-servers, each with `replicas` replicas, on free loopback ports, slots
    spread by `redis-cli --cluster create`; `url` is a redis-cluster:// URL naming two of them as startup nodes."""

    def __init__(self, primaries: int = 3, replicas: int = 0) -> None:
        self.replicas = replicas
        # the cluster bus port is given (by default it is the port + 10000, which a free port may not allow)
        self.nodes = [RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                  "--cluster-node-timeout", "5000", "--cluster-port", str(_free_port()))
                      for _ in range(primaries * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:2])

    def start(self) -> "RedisClusterServers":
        for node in self.nodes:
            node.start()
        subprocess.run([shutil.which("redis-cli") or "/usr/bin/redis-cli", "--cluster", "create",
                        *[f"127.0.0.1:{node.port}" for node in self.nodes], "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, timeout=WAIT_S)
        wait_until(self._ok, WAIT_S, what="cluster_state:ok on every node", interval=0.1)
        return self

    def _ok(self) -> bool:
        for node in self.nodes:
            if node.proc is None:  # killed by the test
                continue
            with node.client() as client:
                if client.cluster("info").get("cluster_state") != "ok":
                    return False
        return True

    def primaries(self) -> list[RedisServer]:
        """The running nodes that serve slots now (a promoted replica among them after a failover)."""
        out = []
        for node in self.nodes:
            if node.proc is not None:
                with node.client() as client:
                    if client.info("replication")["role"] == "master":
                        out.append(node)
        return out

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()



class RedisSentinelSetup(_StartedTogether):
    """A primary, one replica and one sentinel (quorum 1, the primary counted down after 1 s) monitoring them as
    `mymaster`; `url` is the redis-sentinel:// URL of the sentinel."""

    def __init__(self) -> None:
        self.primary = RedisServer()
        self.replica = RedisServer("--replicaof", "127.0.0.1", str(self.primary.port))
        self.sentinel = _Sentinel(self.primary.port)

    @property
    def url(self) -> str:
        return f"redis-sentinel://127.0.0.1:{self.sentinel.port}/mymaster"

    def start(self) -> "RedisSentinelSetup":
        self.primary.start()
        self.replica.start()
        with self.replica.client() as replica:
            wait_until(lambda: replica.info("replication").get("master_link_status") == "up", WAIT_S,
                       what="the replica in sync", interval=0.1)
        self.sentinel.start()
        with self.sentinel.client() as client:  # the sentinel learns of the replica from the primary's INFO
            wait_until(lambda: client.sentinel_slaves("mymaster"), WAIT_S, what="the sentinel seeing the replica",
                       interval=0.2)
        return self

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.primary):
            server.stop()



class _Sentinel(RedisServer):
    def __init__(self, primary_port: int) -> None:
        super().__init__()
        self.primary_port = primary_port

    def argv(self) -> list[str]:
        config = self.dir / "sentinel.conf"  # the sentinel rewrites its config file: it must be its own
        config.write_text(f"sentinel monitor mymaster 127.0.0.1 {self.primary_port} 1\n"
                          "sentinel down-after-milliseconds mymaster 1000\n"
                          "sentinel failover-timeout mymaster 5000\n")
        return [REDIS_SERVER, str(config), "--sentinel", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")]
