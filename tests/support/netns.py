"""Hosts on one machine for tests that need a network between hosts: Linux network namespaces, each with one
interface on a bridge in the test's own namespace, an address of 10.x.y.0/24 each, and loopback (`Hosts`);
`Sniffer` reads every frame that crosses the bridge (an AF_PACKET socket), as a tap on the wire between hosts.

Needs root (CAP_NET_ADMIN) and the `ip` command; `Hosts.skip_reason()` says why not where they cannot be made, for
`pytest.skip`. Names carry the test process's pid, so parallel runs do not collide; everything is removed at exit
(the namespaces' processes are killed first).
"""

from __future__ import annotations

import os
import shutil
import socket
import itertools
import subprocess
import threading
from pathlib import Path
from typing import Any

_MADE = itertools.count()  # hosts made by this process: each set of names is new (a deleted namespace's
# interfaces go away asynchronously)
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33  # root may set a receive buffer past rmem_max


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """`count` hosts: `names[i]` is host i's namespace, `address(i)` its address on the bridge `bridge`."""

    def __init__(self, count: int) -> None:
        tag = f"{os.getpid() % 100000}{chr(ord('a') + next(_MADE) % 26)}"  # interface names: 15 characters at most
        self.bridge = f"kvbr{tag}"
        self.names = [f"kvh{tag}-{i}" for i in range(count)]
        self.veths = [f"kvv{tag}-{i}" for i in range(count)]
        self._subnet = f"10.{(os.getpid() >> 8) % 200 + 20}.{os.getpid() % 250}"
        self._made: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []

    @staticmethod
    def skip_reason() -> str | None:
        """Why hosts cannot be made here (None: they can)."""
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2) to make network namespaces"
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"kvprobe{os.getpid() % 100000}"
        try:
            _ip("netns", "add", probe)
        except subprocess.CalledProcessError as exc:
            return f"cannot make a network namespace here: {exc.stderr.strip()}"
        _ip("netns", "del", probe)
        return None

    def address(self, host: int) -> str:
        return f"{self._subnet}.{host + 1}"

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("link", "set", self.bridge, "promisc", "on", "up")  # its taps see the frames it forwards (Sniffer)
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                self._made.append(name)
                veth = self.veths[i]
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def popen(self, host: int, argv: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[Any]:
        """`argv` run inside host `host`'s namespace, its output to `log`; killed at exit."""
        out = log.open("ab")
        process = subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], stdout=out,
                                   stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        out.close()
        self._processes.append(process)
        return process

    def run(self, host: int, argv: list[str], env: dict[str, str] | None = None, timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """`argv` run to its end inside host `host`'s namespace; its output captured."""
        return subprocess.run(["ip", "netns", "exec", self.names[host], *argv], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)

    def __exit__(self, *exc: object) -> None:
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, 9)
                except ProcessLookupError:
                    pass
                process.wait(30)
        for made in reversed(self._made):
            if made == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:  # its veth first (at once; the namespace's own cleanup is asynchronous)
                subprocess.run(["ip", "link", "del", self.veths[self.names.index(made)]], capture_output=True)
                subprocess.run(["ip", "netns", "del", made], capture_output=True)
        self._made.clear()


class Sniffer:
    """Every frame crossing `interface` (the hosts' bridge), kept in memory while running; `seen(needle)` says
    whether those bytes crossed in one frame, `frames` how many were read."""

    def __init__(self, interface: str) -> None:
        self._socket = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        # a burst of large (GSO) frames must wait in the socket while this thread is descheduled, not be dropped
        self._socket.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 * 1024 * 1024)
        self._socket.bind((interface, 0))
        self._socket.settimeout(0.2)
        self._captured = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.frames = 0
        self._thread = threading.Thread(target=self._read, daemon=True, name="sniffer")
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self._socket.recv(1 << 18)  # GSO frames reach 64 KiB and more
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self._captured += frame + b"\x00" * 8  # a gap: a needle is not found across two frames
                self.frames += 1

    def seen(self, needle: bytes) -> bool:
        with self._lock:
            return needle in self._captured

    def captured_bytes(self) -> int:
        with self._lock:
            return len(self._captured)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close()
