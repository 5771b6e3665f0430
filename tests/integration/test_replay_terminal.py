"""`consolidation replay` on a terminal (a pseudo-terminal): log lines and the progress bar."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import asyncpg
import orjson

from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import ingest, topics

BAR = re.compile(r"^\[[#.]{30}\] (\d+)/(\d+) memories \((\d+) failed\)$")


def _replay_on_a_terminal(database_url: str, llm_url: str) -> tuple[int, subprocess.Popen[bytes]]:
    """``replay b`` with a pseudo-terminal as its stdout and stderr; returns the terminal's
    controlling side and the process."""
    controller, terminal = pty.openpty()
    # Wide enough that no log line wraps, which would put it on two screen lines.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 1000, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "consolidation.cli", "replay", "b"],
        env={
            **os.environ,
            "CONSOLIDATION_DATABASE_URL": database_url,
            "CONSOLIDATION_LLM_BASE_URL": llm_url,
            "CONSOLIDATION_LLM_BATCH_SIZE": "2",
            "CONSOLIDATION_WAVE_SIZE": "4",
            "CONSOLIDATION_LOG_FORMAT": "json",
            "CONSOLIDATION_LOG_LEVEL": "INFO",
        },
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    return controller, proc


def _read_until_closed(fd: int) -> str:
    """Everything written to the terminal until its last writer is gone."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the process and its children closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def screen(raw: str) -> list[str]:
    """The lines a terminal shows after ``raw``: carriage returns move back to the start of
    the line, ``ESC [ K`` erases to its end, colours are dropped."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", raw)
    lines = [""]
    col = 0
    i = 0
    while i < len(text):
        if text.startswith("\x1b[K", i):
            lines[-1] = lines[-1][:col]
            i += 3
            continue
        char = text[i]
        if char == "\r":
            col = 0
        elif char == "\n":
            lines.append("")
            col = 0
        else:
            line = lines[-1].ljust(col)
            lines[-1] = line[:col] + char + line[col + 1 :]
            col += 1
        i += 1
    return [line for line in lines if line]


def test_the_screen_model_overwrites_and_erases_as_a_terminal_does() -> None:
    assert screen("[..] 1/2\r[##] 2/2\n") == ["[##] 2/2"]
    assert screen("long bar\r\x1b[Klog\nlong bar") == ["log", "long bar"]
    assert screen("bar\x1b[1mlog\x1b[0m\n") == ["barlog"]


async def test_on_a_terminal_log_lines_appear_above_the_progress_bar_then_a_summary(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    await ingest(pool, "b", topics(3, 4))
    controller, proc = _replay_on_a_terminal(database_url, fake.url)
    try:
        raw = await asyncio.to_thread(_read_until_closed, controller)
        assert await asyncio.to_thread(proc.wait, 60) == 0, raw
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    lines = screen(raw)
    *logged, bar, summary = lines
    assert re.match(r"operation \S+ completed: 12 memories processed .*; \d+\.\d s$", summary)
    assert (match := BAR.match(bar)) and match.groups() == ("12", "12", "0"), lines
    # Every other line is one whole log record: the bar never ran into one.
    events = [orjson.loads(line)["event"] for line in logged]
    assert events.count("batch") == 6, events
    # ... and the records were written while the bar was on the screen, above it.
    first_bar = raw.index(" memories (")
    assert raw.rindex('"event":"batch"') > first_bar
    assert raw.count(" memories (") > events.count("batch")
