"""Process helpers for tests: is a pid alive, wait for it to die, its peak memory."""

import os
from pathlib import Path

from support.waiting import WAIT_S, wait_until


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = WAIT_S) -> bool:
    """Whether `pid` died within `timeout` seconds (a generous deadline: it only matters when it never dies)."""
    try:
        wait_until(lambda: not pid_alive(pid), timeout, what=f"pid {pid} to exit", interval=0.05)
    except TimeoutError:
        return False
    return True


def peak_rss_mib(pid: int) -> float:
    """The most resident memory `pid` has held (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")
