"""The token budget of one run's bank, as the run sees it between two records of its usage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from consolidation.budgets import Window
from consolidation.engine.member import BatchReport


@dataclass(eq=False)
class TokenBudget:
    """The bank's budget and the window's usage as last read from the database (``window``),
    plus the tokens of the waves not closed yet, counted live from their batches' perf: a pass
    may start while their sum is below the budget (:meth:`exhausted`)."""

    setting: int | None = None  # CONSOLIDATION_BANK_TOKEN_BUDGET
    window: Window | None = None
    _open: dict[int, Sequence[Sequence[BatchReport]]] = field(default_factory=dict)

    def track(self, wave: int, reports: Sequence[Sequence[BatchReport]]) -> None:
        """Count the tokens of ``wave``'s batches until its usage is recorded."""
        self._open[wave] = reports

    def recorded(self, wave: int, window: Window | None) -> None:
        """``wave``'s usage is in the database now, which answered ``window``."""
        self._open.pop(wave, None)
        if window is not None:
            self.window = window

    def unrecorded(self) -> int:
        return sum(
            r.perf.prompt_tokens + r.perf.completion_tokens
            for reports in self._open.values()
            for group in reports
            for r in group
        )

    def exhausted(self) -> bool:
        """Whether the bank's tokens in the window, this run's unrecorded ones included, have
        reached its budget (never without one)."""
        window = self.window
        if window is None or window.limit is None:
            return False
        return window.used + self.unrecorded() >= window.limit
