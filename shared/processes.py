"""Small facts about other processes, used where files or segments are named after the pid that made them."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
