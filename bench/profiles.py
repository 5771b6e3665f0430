"""Summaries of a py-spy ``--format raw`` profile (collapsed stacks: ``frame;frame;… count``).

py-spy samples the engine's thread only while it is on a CPU, so the shares are shares of the
engine's CPU time (waiting on Postgres or the LLM is excluded).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

# First matching rule wins; checked against the frame's file path.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("aiohttp/yarl/multidict (LLM HTTP client)", r"(aiohttp|yarl|multidict|aiohappyeyeballs)/"),
    ("httpx/httpcore/h11/anyio", r"(httpx|httpcore|h11|anyio|sniffio)/"),
    ("asyncpg (database driver)", r"asyncpg/"),
    ("structlog/logging", r"(structlog|logging)/"),
    ("prometheus_client", r"prometheus_client/"),
    ("consolidation.prompts (request/answer JSON)", r"consolidation/prompts\.py"),
    ("consolidation.llm", r"consolidation/llm\.py"),
    ("consolidation.store", r"consolidation/store\.py"),
    ("consolidation.engine", r"consolidation/engine\.py"),
    ("consolidation (other)", r"consolidation/"),
    ("event loop (uvloop or asyncio)", r"asyncio/|selectors\.py|uvloop/"),
)
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]*?)(?::(?P<line>\d+))?\)$")


def _parse(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for raw in path.read_text().splitlines():
        stack, _, count = raw.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def _frame_file(frame: str) -> str:
    m = _FRAME.match(frame)
    return m.group("file") if m else frame


def _frame_name(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m.group('func')} ({m.group('file')})"


def _category(frame: str) -> str | None:
    file = _frame_file(frame)
    for name, pattern in CATEGORIES:
        if re.search(pattern, file):
            return name
    return None


def _charge(frames: list[str]) -> str | None:
    """Who a sample is charged to: below the deepest ``consolidation`` frame, the library the
    engine called (an asyncio socket write inside httpx counts for httpx); without one, the
    innermost categorised frame (the loop itself, asyncpg's protocol callbacks)."""
    deepest = max(
        (i for i, f in enumerate(frames) if "consolidation/" in _frame_file(f)), default=None
    )
    if deepest is not None:
        for frame in frames[deepest + 1 :]:
            found = _category(frame)
            if found is not None and not found.startswith("consolidation"):
                return found
        return _category(frames[deepest])
    for frame in reversed(frames):
        found = _category(frame)
        if found is not None:
            return found
    return None


def summarize(path: Path, top: int = 25) -> dict[str, Any]:
    """Self time by function, time by library (see :func:`_charge`), and inclusive time of the
    package's own functions."""
    stacks = _parse(path)
    total = sum(count for _, count in stacks) or 1
    leaf: Counter[str] = Counter()
    category: Counter[str] = Counter()
    engine_callers: Counter[str] = Counter()
    for frames, count in stacks:
        leaf[_frame_name(frames[-1])] += count
        category[_charge(frames) or "other (builtins, interpreter)"] += count
        for frame in frames:
            if "consolidation/" in _frame_file(frame):
                engine_callers[_frame_name(frame)] += count
    return {
        "samples": total,
        "by_library": {k: round(v / total, 4) for k, v in category.most_common()},
        "self_top": [(name, round(v / total, 4)) for name, v in leaf.most_common(top)],
        "consolidation_inclusive": [
            (name, round(v / total, 4)) for name, v in engine_callers.most_common(top)
        ],
    }


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"py-spy samples on CPU: {summary['samples']}",
        "",
        "by library the engine called (see bench/profiles.py):",
    ]
    lines += [f"  {share:6.1%}  {name}" for name, share in summary["by_library"].items()]
    lines += ["", "self time, top functions:"]
    lines += [f"  {share:6.1%}  {name}" for name, share in summary["self_top"]]
    lines += ["", "consolidation functions, inclusive:"]
    lines += [f"  {share:6.1%}  {name}" for name, share in summary["consolidation_inclusive"]]
    return "\n".join(lines)
