"""Waiting on a condition with a deadline: the one way tests synchronise with the code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Poll ``condition`` (sync or async) until truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.02)
