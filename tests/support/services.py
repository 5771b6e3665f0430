"""Start real `consolidation serve` processes and watch their JSON logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.support.waiting import wait_for


def worker_env(database_url: str, llm_url: str, **extra: str) -> dict[str, str]:
    """Environment of a worker under test: small batches, fast polling and retries, no LLM
    retries and no automatic consolidation on ingest; ``extra`` (full variable names) wins."""
    return {
        "CONSOLIDATION_DATABASE_URL": database_url,
        "CONSOLIDATION_LLM_BASE_URL": llm_url,
        "CONSOLIDATION_LLM_BATCH_SIZE": "2",
        "CONSOLIDATION_LLM_MAX_RETRIES": "0",
        "CONSOLIDATION_POLL_INTERVAL_S": "0.2",
        "CONSOLIDATION_RETRY_BACKOFF_S": "0",
        "CONSOLIDATION_AUTO_CONSOLIDATE": "false",
        **extra,
    }


def variables(**settings: str) -> dict[str, str]:
    """Settings as environment variables: ``LEASE_S="1"`` is ``CONSOLIDATION_LEASE_S="1"``."""
    return {f"CONSOLIDATION_{key}": value for key, value in settings.items()}


async def metric_total(urls: list[str], name: str) -> float:
    """The sum of an unlabelled metric over the ``/metrics`` of several processes."""
    total = 0.0
    async with httpx.AsyncClient(timeout=30) as http:
        for url in urls:
            for line in (await http.get(f"{url}/metrics")).text.splitlines():
                if line.startswith(name + " "):
                    total += float(line.split()[1])
    return total


class ServiceProcess:
    """One `consolidation serve` process with its log in a file (JSON lines)."""

    def __init__(self, name: str, log_dir: Path, env: dict[str, str], *args: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log_file = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consolidation.cli", "serve", *args],
            env={
                **os.environ,
                "CONSOLIDATION_LOG_FORMAT": "json",
                "CONSOLIDATION_LOG_LEVEL": "INFO",
                "CONSOLIDATION_HTTP_PORT": "0",
                **env,
            },
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_bytes().splitlines():
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict) and (name is None or record.get("event") == name):
                out.append(record)
        return out

    async def wait_event(self, name: str, timeout_s: float = 60, **fields: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            if self.proc.poll() is not None and not self._matching(name, fields):
                raise AssertionError(
                    f"{self.name} exited ({self.proc.returncode}) before logging {name}:\n"
                    + self.log_path.read_text()[-3000:]
                )
            matches = self._matching(name, fields)
            return matches[0] if matches else None

        event: dict[str, Any] = await wait_for(found, timeout_s, what=f"{self.name}: {name}")
        return event

    def _matching(self, name: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in self.events(name) if all(e.get(k) == v for k, v in fields.items())]

    async def api_url(self) -> str:
        url: str = (await self.wait_event("api_listening"))["url"]
        return url

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = 60) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        """Tear-down: make sure nothing outlives the test."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log_file.close()


class Services:
    """The `consolidation serve` processes of one test, their logs in ``log_dir``; whatever still
    runs at tear-down is killed (:meth:`stop_all`)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[ServiceProcess] = []

    def start(self, name: str, env: dict[str, str], *args: str) -> ServiceProcess:
        """Start ``consolidation serve *args`` with exactly ``env`` over the test's environment."""
        service = ServiceProcess(name, self.log_dir, env, *args)
        self.started.append(service)
        return service

    def stop_all(self) -> None:
        for service in self.started:
            service.stop()


class Serve:
    """Starts workers and services on the test's database and fake LLM with :func:`worker_env`;
    a keyword ``LEASE_S="1"`` sets ``CONSOLIDATION_LEASE_S``."""

    def __init__(self, services: Services, database_url: str, llm_url: str) -> None:
        self.services = services
        self.database_url = database_url
        self.llm_url = llm_url

    def __call__(
        self, name: str, *args: str, database_url: str | None = None, **settings: str
    ) -> ServiceProcess:
        """``consolidation serve *args``; ``database_url`` replaces the test's (a proxy's)."""
        env = worker_env(
            database_url or self.database_url,
            self.llm_url,
            **variables(**settings),
        )
        return self.services.start(name, env, *args)

    def worker(self, name: str, **settings: str) -> ServiceProcess:
        """A worker without its API (``--no-api``)."""
        return self(name, "--no-api", **settings)
