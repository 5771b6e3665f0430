"""What every kind of run is given: one claimed attempt and the resources to work on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import asyncpg

from consolidation.engine.stop import StopSignal
from consolidation.engine.summary import ProgressCallback, RunSummary
from consolidation.llm.client import Consolidator
from consolidation.llm.embeddings import Embedder
from consolidation.queue import Lease
from consolidation.settings import Settings


@dataclass(frozen=True)
class RunContext:
    """One claimed attempt (``lease``) with its pool, model clients, settings and stop signal.
    ``on_progress`` and ``slice_s`` are a consolidation's (a forget reports neither)."""

    pool: asyncpg.Pool
    lease: Lease
    llm: Consolidator
    settings: Settings
    stop: StopSignal
    on_progress: ProgressCallback | None = None
    embedder: Embedder | None = None
    slice_s: float | None = None


class Run(Protocol):
    """One kind of operation's work on a claimed attempt; ``summary`` holds what it did so far,
    also when :meth:`run` raised."""

    @property
    def summary(self) -> RunSummary: ...

    async def run(self) -> RunSummary: ...
