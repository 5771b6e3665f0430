"""A memory while its wave runs, and what one batch of a group reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from consolidation import store
from consolidation.perf import PerfLog
from consolidation.scopes import Scope


@dataclass
class MemoryState:
    """One memory while its wave runs."""

    memory: store.WaveMemory
    todo: tuple[Scope, ...]  # the scopes this operation passes: not journaled, within the filter
    applied: dict[Scope, str] = field(default_factory=dict)  # scope → action, this operation
    failure: str | None = None  # why it is marked failed

    def remaining(self) -> tuple[Scope, ...]:
        """The scopes still to pass (none once failed)."""
        if self.failure is not None:
            return ()
        if not self.applied:
            return self.todo  # asked for every member and scope of every pass planned
        return tuple(s for s in self.todo if s not in self.applied)

    def finished(self) -> bool:
        return self.failure is None and set(self.memory.scopes) <= (
            self.memory.journaled | self.applied.keys()
        )

    def result(self) -> str | None:
        """DESIGN §2's per-memory result of this operation, once it is finished or failed; None
        when the journal alone finished it (an earlier attempt did the work: ``recovered``)."""
        if self.failure is not None:
            return "failed"
        acted = [a for a in self.applied.values() if a != "skipped"]
        if len(acted) > 1:
            return "multiple"
        if acted:
            return acted[0]
        return "skipped" if self.applied else None


@dataclass
class BatchReport:
    """One batch of a group: its members and what its passes cost, logged when its wave closes."""

    group: int
    number: int
    scopes: tuple[Scope, ...]
    members: Sequence[MemoryState]
    perf: PerfLog
