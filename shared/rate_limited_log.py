"""A logger's WARNINGs at most once per interval per cause, so a failure that repeats per chunk is no flood."""

from __future__ import annotations

import collections
import logging
import threading
import time


class RateLimitedLog:
    """Logs a message at most once per `interval` seconds per key, counting what it held back."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self._interval:
                self._suppressed[key] += 1
                return
            self._last[key] = now
            held_back = self._suppressed.pop(key, 0)
        suffix = f" ({held_back} more like this since the last report)" if held_back else ""
        self._log.warning(msg + suffix, *args)
