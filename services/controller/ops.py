"""Event ids for `/check_finish`: every lookup, pin, unpin and clear gets one, tracked to completion or error.

Runs on the controller's event loop (REST handlers record, `/check_finish` reads); no lock needed.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Literal

EventStatus = Literal["pending", "finished", "failed"]


@dataclass(slots=True)
class EventRecord:
    kind: str  # "lookup", "pin", "unpin", "clear", ...
    created: float
    status: EventStatus = "pending"
    error: str | None = None
    num_tokens: int | None = None


class EventLog:
    """The status of recent operations by event_id, bounded in count and age.

    Invariant: ids are kept in creation order; the oldest is dropped when more than `max_events` are held or
    when it is older than `max_age_s` (checked on every insert, so the log never grows past its bounds). An
    id that was dropped or never issued is unknown (`get` returns None, the API answers 404).
    """

    def __init__(self, max_events: int = 100_000, max_age_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.max_events = max_events
        self.max_age_s = max_age_s
        self._clock = clock
        self._events: OrderedDict[str, EventRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._events)

    def new(self, kind: str, status: EventStatus = "pending") -> str:
        """Issue an event id (uuid4 hex) for a new operation."""
        now = self._clock()
        events = self._events
        while events and (len(events) >= self.max_events
                          or now - next(iter(events.values())).created > self.max_age_s):
            events.popitem(last=False)
        event_id = uuid.uuid4().hex
        events[event_id] = EventRecord(kind=kind, created=now, status=status)
        return event_id

    def finish(self, event_id: str, num_tokens: int | None = None) -> None:
        record = self._events.get(event_id)
        if record is not None:
            record.status, record.num_tokens = "finished", num_tokens

    def fail(self, event_id: str, error: str) -> None:
        record = self._events.get(event_id)
        if record is not None:
            record.status, record.error = "failed", error

    def items(self) -> list[tuple[str, EventRecord]]:
        """(event_id, record) pairs, oldest first (a snapshot)."""
        return list(self._events.items())

    def get(self, event_id: str) -> EventRecord | None:
        record = self._events.get(event_id)
        if record is not None and self._clock() - record.created > self.max_age_s:
            return None
        return record
