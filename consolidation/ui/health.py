"""LLM and embeddings requests of this process over the last minutes, from its Prometheus
counters (metrics.py), which only count since the process started.

Counters only grow, so a window is the difference between now and a sample taken at least the
window's length ago. Samples are taken when the dashboard renders (and once at start-up), so the
window a page shows is stated with its real length.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from consolidation.metrics import EMBEDDING_REQUESTS, LLM_REQUESTS

WINDOW_S = 300.0
SAMPLE_EVERY_S = 5.0
LLM_OUTCOMES = ("ok", "retry", "transient", "invalid", "config")


@dataclass(frozen=True)
class Requests:
    """Requests by outcome over the last ``span_s`` seconds (shorter than the window while the
    process is younger than it)."""

    span_s: float
    by_outcome: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_outcome.values())

    @property
    def failing(self) -> int:
        return self.total - self.by_outcome.get("ok", 0)


def counts(counter: Counter) -> dict[str, int]:
    """A labelled counter's current values, by its one label's value."""
    out: dict[str, int] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[next(iter(sample.labels.values()))] = int(sample.value)
    return out


class RequestWindow:
    """Samples of one labelled counter, kept for a window; ``clock`` is monotonic seconds."""

    def __init__(
        self,
        counter: Counter,
        *,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._counter = counter
        self._window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, dict[str, int]]] = deque()
        self.sample()

    def sample(self) -> None:
        now = self._clock()
        if self._samples and now - self._samples[-1][0] < SAMPLE_EVERY_S:
            return
        self._samples.append((now, counts(self._counter)))
        # Keep the newest sample that is at least a window old: it is where the window starts.
        while len(self._samples) > 1 and now - self._samples[1][0] >= self._window_s:
            self._samples.popleft()

    def requests(self, outcomes: tuple[str, ...] = ()) -> Requests:
        """Requests since the oldest kept sample (about one window ago), by outcome."""
        self.sample()
        now = self._clock()
        current = counts(self._counter)
        start_at, start = self._samples[0]
        names = list(outcomes) + sorted(set(current) - set(outcomes))
        return Requests(
            span_s=now - start_at,
            by_outcome={name: current.get(name, 0) - start.get(name, 0) for name in names},
        )


class ProcessRequests:
    """The LLM and embeddings request windows of this process."""

    def __init__(self) -> None:
        self.llm = RequestWindow(LLM_REQUESTS)
        self.embeddings = RequestWindow(EMBEDDING_REQUESTS)
