"""Which event loop the CLI verbs and the service run on (CONSOLIDATION_EVENT_LOOP)."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import inspect
import subprocess
import sys

import pytest

from consolidation import runtime
from consolidation.errors import ConfigError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_auto_runs_on_uvloop_when_it_is_installed() -> None:
    # uvloop is a dependency on every platform CI runs on, so auto must pick it here.
    assert importlib.util.find_spec("uvloop") is not None
    assert runtime.run(_loop_module(), "auto") == "uvloop"


def test_asyncio_can_be_forced() -> None:
    assert runtime.run(_loop_module(), "asyncio") == "asyncio"


def test_asking_for_a_missing_uvloop_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "uvloop" else real_find_spec(name, *args),
    )
    assert runtime.event_loop_name("auto") == "asyncio"
    coro = _loop_module()
    with pytest.raises(ConfigError, match="CONSOLIDATION_EVENT_LOOP=uvloop"):
        runtime.run(coro, "uvloop")
    # Closed, not left to warn "never awaited".
    assert inspect.getcoroutinestate(coro) == "CORO_CLOSED"


def test_the_consolidation_command_tunes_its_collector_before_it_runs() -> None:
    # In a process of its own: entry() changes the collector of the process it runs in.
    probe = (
        "import gc, consolidation.cli as cli\n"
        "cli.main = lambda: print(*gc.get_threshold(), gc.get_freeze_count()) or 0\n"
        "raise SystemExit(cli.entry())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    *thresholds, frozen = map(int, done.stdout.split())
    assert tuple(thresholds) == runtime.GC_THRESHOLDS != gc.get_threshold()
    # Start-up's objects (every module imported so far) are out of the collector's walks.
    assert frozen > 10_000
