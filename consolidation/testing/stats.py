"""The fake's tally of calls: per-endpoint counters by status and the recorded calls, bounded so
long load tests keep a fixed memory."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

# Long load tests must not grow memory without bound; the oldest calls are dropped first.
MAX_RECORDED_CALLS = 10_000


class _Tally:
    """The counters of one endpoint of the fake; used only under the fake's lock."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.requests = 0
        self.completed = 0
        self.failed = 0
        self.aborted = 0
        self.statuses: Counter[int] = Counter()
        self.calls: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDED_CALLS)

    def begin(self, record: dict[str, Any]) -> None:
        self.calls.append(record)
        self.requests += 1

    def finish(self, record: dict[str, Any], status: int | None) -> None:
        """``status`` None means the client went away first."""
        record["status"] = status
        record["ended"] = time.monotonic()
        if status is None:
            self.aborted += 1
            return
        self.statuses[status] += 1
        if status == 200:
            self.completed += 1
        else:
            self.failed += 1

    def counts(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "failed": self.failed,
            "aborted": self.aborted,
            "statuses": dict(self.statuses),
        }


class _Call:
    """One recorded request; mutated only under the fake's lock."""

    __slots__ = ("record", "scope_key")

    def __init__(self, record: dict[str, Any], scope_key: tuple[str, tuple[str, ...]] | None):
        self.record = record
        self.scope_key = scope_key
