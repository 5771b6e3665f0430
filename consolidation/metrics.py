"""Prometheus objects (default registry) and the event-loop lag monitor (DESIGN §9).

Every metric is module-level so any module can record into it without wiring; `/metrics` serves
the default registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from types import TracebackType

import structlog
from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "BANK_TOKENS",
    "BUDGET_PAUSES",
    "EMBEDDING_INPUTS",
    "EMBEDDING_LATENCY",
    "EMBEDDING_REQUESTS",
    "EVENT_LOOP_LAG",
    "FORGOTTEN",
    "LLM_HEDGES",
    "LLM_IN_FLIGHT",
    "LLM_LATENCY",
    "LLM_REQUESTS",
    "LLM_RETRY_AFTER",
    "LLM_TOKENS",
    "MEMORIES",
    "OPERATIONS",
    "OPERATIONS_RUNNING",
    "OPERATION_SLICES",
    "SWEPT",
    "EventLoopLagMonitor",
]

log = structlog.get_logger(__name__)

OPERATIONS = Counter(
    "consolidation_operations",
    "Consolidation operations that ended, by final status.",
    ["status"],
)
MEMORIES = Counter(
    "consolidation_memories",
    "Memories consolidated, by per-memory result (created, updated, merged, multiple, skipped, "
    "failed).",
    ["action"],
)
LLM_REQUESTS = Counter(
    "consolidation_llm_requests",
    "HTTP requests made to the LLM, by outcome: ok, retry (a retried attempt), transient "
    "(retries exhausted), invalid (unusable answer), config (401/403/404).",
    ["outcome"],
)
LLM_LATENCY = Histogram(
    "consolidation_llm_latency_seconds",
    "Duration of one HTTP request to the LLM, whatever its outcome.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0),
)
LLM_IN_FLIGHT = Gauge(
    "consolidation_llm_in_flight",
    "HTTP requests to the LLM currently in flight in this process.",
)
LLM_TOKENS = Counter(
    "consolidation_llm_tokens",
    "Tokens reported by the LLM (usage), by kind: prompt or completion.",
    ["kind"],
)
LLM_RETRY_AFTER = Counter(
    "consolidation_llm_retry_after_honoured",
    "Retries whose delay came from the server's Retry-After header.",
)
LLM_HEDGES = Counter(
    "consolidation_llm_hedges",
    "Hedged LLM requests (CONSOLIDATION_LLM_HEDGE_QUANTILE), by outcome: first or copy (which "
    "answered first), neither (both failed) or preempted (a copy aborted to free its slot).",
    ["outcome"],
)
EMBEDDING_REQUESTS = Counter(
    "consolidation_embedding_requests",
    "HTTP requests made to the embeddings endpoint, by outcome: ok, retry (a retried attempt), "
    "transient (retries exhausted), config (misconfiguration), refused_input (a text the "
    "server refused, left without a vector).",
    ["outcome"],
)
EMBEDDING_INPUTS = Counter(
    "consolidation_embedding_inputs",
    "Texts embedded successfully (facts of passes and observations written).",
)
EMBEDDING_LATENCY = Histogram(
    "consolidation_embedding_latency_seconds",
    "Duration of one HTTP request to the embeddings endpoint, whatever its outcome.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
OPERATIONS_RUNNING = Gauge(
    "consolidation_operations_running",
    "Consolidation operations currently running in this process.",
)
EVENT_LOOP_LAG = Gauge(
    "consolidation_event_loop_lag_seconds",
    "Event-loop lag (actual wake-up minus scheduled wake-up) over the monitor's sliding window.",
    ["quantile"],
)

OPERATION_SLICES = Counter(
    "consolidation_operation_slices",
    "Operations that gave their worker slot up at the end of a time slice because others waited "
    "(CONSOLIDATION_OPERATION_SLICE_S); they continue later under the same id.",
)
BANK_TOKENS = Counter(
    "consolidation_bank_tokens",
    "Prompt and completion tokens the passes of each bank's consolidations used, recorded when "
    "each wave closes (what CONSOLIDATION_BANK_TOKEN_BUDGET is counted against).",
    ["bank_id"],
)
BUDGET_PAUSES = Counter(
    "consolidation_budget_pauses",
    "Operations handed back to pending because their bank's token budget was used; they "
    "resume under the same id once the rolling 24 h window frees enough.",
)
SWEPT = Counter(
    "consolidation_sweeper_enqueued",
    "Operations the sweeper enqueued for banks nobody triggered, by kind (consolidate, forget).",
    ["kind"],
)
FORGOTTEN = Counter(
    "consolidation_forgotten_memories",
    "Memories deleted by forget operations in this process.",
)

_WARN_EVERY_S = 30.0


def _quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted, non-empty list."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class EventLoopLagMonitor:
    """Samples event-loop lag every ``interval_s`` while entered (``async with``).

    Keeps the last ``window`` samples, publishes p50/p99/max to ``EVENT_LOOP_LAG`` and logs a
    warning (at most once per 30 s) while p99 exceeds ``warn_p99_s``.
    """

    def __init__(self, interval_s: float = 0.1, window: int = 600, warn_p99_s: float = 0.1) -> None:
        if interval_s <= 0 or window <= 0:
            raise ValueError("interval_s and window must be positive")
        self._interval_s = interval_s
        self._warn_p99_s = warn_p99_s
        self._samples: deque[float] = deque(maxlen=window)
        self._task: asyncio.Task[None] | None = None
        self._last_warning: float | None = None

    async def __aenter__(self) -> EventLoopLagMonitor:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-loop-lag-monitor")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def snapshot(self) -> dict[str, float]:
        """Lag over the current window: ``p50_ms``, ``p99_ms``, ``max_ms`` and ``samples``."""
        ordered = sorted(self._samples)
        if not ordered:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "samples": 0.0}
        return {
            "p50_ms": _quantile(ordered, 0.50) * 1000.0,
            "p99_ms": _quantile(ordered, 0.99) * 1000.0,
            "max_ms": ordered[-1] * 1000.0,
            "samples": float(len(ordered)),
        }

    def reset(self) -> None:
        """Forget every sample (the gauges keep their last values until the next sample)."""
        self._samples.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            scheduled = loop.time() + self._interval_s
            await asyncio.sleep(self._interval_s)
            self._samples.append(max(0.0, loop.time() - scheduled))
            self._publish()

    def _publish(self) -> None:
        # Sorting a 600-sample window ten times a second costs microseconds; simpler than
        # maintaining an order-statistics structure.
        snap = self.snapshot()
        p99_s = snap["p99_ms"] / 1000.0
        EVENT_LOOP_LAG.labels(quantile="p50").set(snap["p50_ms"] / 1000.0)
        EVENT_LOOP_LAG.labels(quantile="p99").set(p99_s)
        EVENT_LOOP_LAG.labels(quantile="max").set(snap["max_ms"] / 1000.0)
        if p99_s <= self._warn_p99_s:
            return
        now = time.monotonic()
        if self._last_warning is not None and now - self._last_warning < _WARN_EVERY_S:
            return
        self._last_warning = now
        log.warning(
            "event_loop_lag_high",
            p50_ms=round(snap["p50_ms"], 1),
            p99_ms=round(snap["p99_ms"], 1),
            max_ms=round(snap["max_ms"], 1),
            threshold_ms=round(self._warn_p99_s * 1000.0, 1),
            hint="CPU-heavy work is blocking the event loop; move it to a thread",
        )
