"""Summaries of the engine's profiles: py-spy's ``--format raw`` (collapsed stacks:
``frame;frame;… count``) and ``perf record``'s on-CPU samples.

py-spy leaves out a thread that sleeps (waiting on Postgres or the LLM), but not one that is
runnable and waiting for a CPU: on two vCPUs a socket write that wakes a Postgres backend often
hands it the engine's CPU, and py-spy charges that wait to the write. In one zero-latency run
py-spy put 31 % of the engine's samples in asyncpg's ``_do_execute`` and 7 % in
aiohttp's ``_writelines``; perf, which samples only what is on a CPU, put every socket write
of the engine at 5.6 %. Read py-spy's shares for where the Python code spends, perf's for
what the CPU does (:func:`perf_split`).
"""

from __future__ import annotations

import re
import subprocess
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
    ("consolidation.llm.prompts (request/answer JSON)", r"consolidation/llm/prompts\.py"),
    ("consolidation.llm.client", r"consolidation/llm/client\.py"),
    ("consolidation.store", r"consolidation/store\.py"),
    ("consolidation.engine", r"consolidation/engine/"),
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
        "by library the engine called (see bench/perf/profiles.py):",
    ]
    lines += [f"  {share:6.1%}  {name}" for name, share in summary["by_library"].items()]
    lines += ["", "self time, top functions:"]
    lines += [f"  {share:6.1%}  {name}" for name, share in summary["self_top"]]
    lines += ["", "consolidation functions, inclusive:"]
    lines += [f"  {share:6.1%}  {name}" for name, share in summary["consolidation_inclusive"]]
    return "\n".join(lines)


# Kernel functions whose inclusive share says what the engine's system calls were for.
_KERNEL_PATHS = {
    "tcp_sendmsg": "socket writes (Postgres and the LLM, loopback TCP)",
    "tcp_recvmsg": "socket reads",
    "do_epoll_wait": "epoll_wait",
}


def perf_split(data: Path) -> dict[str, Any]:
    """The on-CPU samples of a ``perf record`` by shared object (the interpreter, the kernel,
    each extension) and the kernel paths of :data:`_KERNEL_PATHS`, as shares of all samples."""
    by_object = _perf_report(data, "--no-children", "--sort", "dso")
    symbols = _perf_report(data, "--children", "--sort", "sym")
    kernel = {
        label: symbols[f"[k] {name}"]
        for name, label in _KERNEL_PATHS.items()
        if f"[k] {name}" in symbols
    }
    return {"by_object": by_object, "kernel_paths": kernel}


def _perf_report(data: Path, *sort: str) -> dict[str, float]:
    text = subprocess.run(
        ["perf", "report", "--input", str(data), "--stdio", "--quiet", "-g", "none", *sort],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_perf_report(text)


def parse_perf_report(text: str) -> dict[str, float]:
    """``perf report --stdio --quiet`` rows as {name: share}: the first percentage of a row
    (with ``--children``, the inclusive one) and what follows the percentages."""
    shares: dict[str, float] = {}
    for line in text.splitlines():
        cells = line.split()
        percents = [c for c in cells if c.endswith("%")]
        if not percents:
            continue
        name = " ".join(cells[len(percents) :])
        shares.setdefault(name, round(float(percents[0].rstrip("%")) / 100, 4))
    return shares


def render_perf(split: dict[str, Any], top: int = 12) -> str:
    lines = ["perf, the engine's on-CPU samples by object:"]
    lines += [f"  {share:6.1%}  {name}" for name, share in list(split["by_object"].items())[:top]]
    lines += ["", "of which in the kernel, inclusive:"]
    lines += [f"  {share:6.1%}  {name}" for name, share in split["kernel_paths"].items()]
    return "\n".join(lines)
