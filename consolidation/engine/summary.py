"""What an operation did, as stored in ``operations.result`` and reported as progress."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from consolidation.perf import PerfLog


@dataclass
class RunSummary:
    """What an operation did; stored (as JSON) in ``operations.result``."""

    perf: PerfLog = field(default_factory=PerfLog)
    waves: int = 0
    processed: int = 0
    consolidated: int = 0
    failed: int = 0
    recovered: int = 0
    total: int = 0
    slices: int = 0  # how many times the operation yielded its slot to waiting ones
    pauses: int = 0  # how many times its bank's token budget handed it back

    @classmethod
    def resumed(cls, result: Mapping[str, Any] | None) -> RunSummary:
        """The summary an operation's earlier slices stored, to continue; empty without one."""
        if not result:
            return cls()
        return cls(
            perf=PerfLog.from_dict(result.get("perf", {})),
            **{k: int(result.get(k, 0)) for k in _CONTINUED},
        )

    def progress(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "processed": self.processed,
            "consolidated": self.consolidated,
            "failed": self.failed,
            "waves": self.waves,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **self.progress(),
            "recovered": self.recovered,
            "slices": self.slices,
            "pauses": self.pauses,
            "perf": self.perf.to_dict(),
        }


_CONTINUED = ("waves", "processed", "consolidated", "failed", "recovered", "slices", "pauses")


ProgressCallback = Callable[[RunSummary], None]
