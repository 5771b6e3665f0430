"""PerfLog: counters and timings of one batch, summed into the operation's total. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields

_ACTIONS = frozenset({"created", "updated", "merged", "multiple", "skipped", "failed"})


@dataclass
class PerfLog:
    """What one batch (or, summed, one operation) cost and produced.

    Every field is a number and ``+=`` adds them all, so a field added later is never lost.
    """

    memories: int = 0
    llm_calls: int = 0
    llm_failures: int = 0
    llm_retries: int = 0
    llm_repairs: int = 0
    llm_repaired: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_chars: int = 0
    recall_s: float = 0.0
    llm_s: float = 0.0
    apply_s: float = 0.0
    embedding_requests: int = 0  # to the embeddings endpoint (0 unless embeddings are configured)
    embedding_s: float = 0.0
    created: int = 0
    updated: int = 0
    merged: int = 0
    multiple: int = 0
    skipped: int = 0
    failed: int = 0
    splits: int = 0

    def __iadd__(self, other: PerfLog) -> PerfLog:
        """Add ``other`` field by field into this log; returns self."""
        if not isinstance(other, PerfLog):
            return NotImplemented
        for name in _FIELD_NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def __add__(self, other: PerfLog) -> PerfLog:
        """A new log holding the field-wise sum; neither operand changes."""
        if not isinstance(other, PerfLog):
            return NotImplemented
        total = dataclasses.replace(self)
        total += other
        return total

    def count_action(self, action: str) -> None:
        """Count one memory outcome (``created``, ``updated``, … ``failed``)."""
        if action not in _ACTIONS:
            raise ValueError(f"unknown action {action!r}; expected one of {sorted(_ACTIONS)}")
        setattr(self, action, getattr(self, action) + 1)

    def to_dict(self) -> dict[str, int | float]:
        """JSON-ready mapping of every field; timings rounded to microseconds."""
        out: dict[str, int | float] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            out[field.name] = round(value, 6) if isinstance(value, float) else value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> PerfLog:
        """Rebuild a log from :meth:`to_dict` output; unknown keys are ignored, missing are 0."""
        values: dict[str, int | float] = {}
        for field in fields(cls):
            if field.name not in d:
                continue
            value = d[field.name]
            # bool is an int subclass but never a meaningful counter.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"PerfLog.{field.name} must be a number, got {value!r}")
            if isinstance(field.default, float):
                values[field.name] = float(value)
            elif isinstance(value, float) and not value.is_integer():
                raise TypeError(f"PerfLog.{field.name} must be an integer, got {value!r}")
            else:
                values[field.name] = int(value)
        return cls(**values)  # type: ignore[arg-type]


# ``+=`` runs once a pass; ``fields()`` builds its tuple anew on every call.
_FIELD_NAMES = tuple(field.name for field in fields(PerfLog))
