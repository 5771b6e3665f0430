"""Start one engine run in a child process (``python -m bench.perf.child``) and collect its result."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from bench.perf.child import RunSpec

ROOT = Path(__file__).resolve().parents[2]


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
        command = [sys.executable, "-m", "bench.perf.child", str(result_path)]
        if spec.profile == "perf" and spec.profile_out:
            # The kernel's own on-CPU samples (cpu-clock), off until the child switches them on
            # around the operation (RunSpec.perf_control).
            fifos = (cwd / "perf-control", cwd / "perf-ack")
            for fifo in fifos:
                fifo.unlink(missing_ok=True)
                os.mkfifo(fifo)
            data = spec.profile_out + ".perf.data"
            spec = dataclasses.replace(spec, perf_control=",".join(map(str, fifos)))
            command = [
                "perf",
                "record",
                "--event",
                "cpu-clock",
                "--freq",
                "999",
                "--call-graph",
                "fp",
                "--delay",
                "-1",
                "--control",
                f"fifo:{fifos[0]},{fifos[1]}",
                "--output",
                data,
                "--quiet",
                "--",
                *command,
            ]
        if spec.profile == "py-spy" and spec.profile_out:
            # py-spy samples a thread whose state is running, which includes runnable and waiting
            # for a CPU: on two vCPUs, a write that wakes a Postgres backend often hands it the
            # engine's CPU, and the wait is charged to the write (the "perf" profile is not).
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
