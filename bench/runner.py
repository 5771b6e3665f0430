"""Start one engine run in a child process (``python -m bench.child``) and collect its result."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from bench.child import RunSpec

ROOT = Path(__file__).resolve().parent.parent


async def run_child(spec: RunSpec, log_path: Path, timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter; raises when the run fails or does not complete."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # BENCH_OVERLAY (a directory holding a modified copy of the package) goes first, so a proposed
    # engine change can be measured without touching the repository. The child runs in an empty
    # directory: with ``-m`` the working directory is first on sys.path.
    path = [os.environ.get("BENCH_OVERLAY", ""), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    cwd = log_path.parent / ".cwd"
    cwd.mkdir(exist_ok=True)
    with log_path.open("wb") as log:
        result_path = log_path.with_suffix(".result.json")
        result_path.unlink(missing_ok=True)
        command = [sys.executable, "-m", "bench.child", str(result_path)]
        if spec.profile == "py-spy" and spec.profile_out:
            # py-spy samples only while the engine's thread is on a CPU (idle time excluded).
            command = [
                str(Path(sys.executable).with_name("py-spy")),
                "record",
                "--rate",
                "250",
                "--format",
                "raw",
                "--output",
                spec.profile_out + ".collapsed",
                "--",
                *command,
            ]
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=log,
            stderr=log,
            cwd=str(cwd),
            env=env,
        )
        try:
            await asyncio.wait_for(
                process.communicate(orjson.dumps(dataclasses.asdict(spec))), timeout_s
            )
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError(
                f"engine run timed out after {timeout_s:g}s; log: {log_path}"
            ) from None
    if process.returncode != 0:
        raise RuntimeError(f"engine run failed (exit {process.returncode}); log: {log_path}")
    result: dict[str, Any] = orjson.loads(result_path.read_bytes())
    result_path.unlink()
    if result["status"] != "completed":
        raise RuntimeError(
            f"operation ended {result['status']}: {result['error']}; log: {log_path}"
        )
    return result
