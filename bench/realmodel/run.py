"""``python -m bench realmodel``: the service against a real model server, end to end.

It installs (or reuses) llama-cpp-python's OpenAI-compatible server in a venv of its own, fetches
a GGUF model that PyPI packages carry, starts the server, and runs the project's own entry points
against it: a fresh migrated database, ``consolidation ingest`` of a labelled bank, then
``consolidation replay BANK --json`` with ``CONSOLIDATION_LLM_BASE_URL`` at the server. It reports
the LLM figures of the operation and judges the observations against the bank's labels.

Kept out of the default CI: compiling llama.cpp alone takes about 16 minutes on 2 cores, and a
run of the bank takes minutes more on a CPU. See docs/real-models.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from bench.infra import Databases
from bench.perf import report
from bench.realmodel.report import (
    BANK_FILE,
    Bank,
    ObservationSeen,
    judge,
    llm_figures,
    load_bank,
    log_events,
    render_table,
)
from bench.realmodel.server import (
    DEFAULT_HOME,
    DEFAULT_MODEL,
    MODELS,
    LlamaServer,
    describe_model,
    ensure_server_venv,
    fetch_model,
)
from consolidation import db, store

Log = Callable[[str], None]
# What the lane sets unless told otherwise: a CPU model needs minutes per call, and
# llama-cpp-python answers one request at a time, so a second one in flight would only wait
# inside the server with its client timeout running.
LANE_DEFAULTS = {
    "CONSOLIDATION_LLM_TIMEOUT_S": "900",
    "CONSOLIDATION_LLM_MAX_CONCURRENT": "1",
}
_SECRET_WORDS = ("KEY", "PASSWORD", "SECRET", "TOKEN")
__all__ = ["LaneOptionsHelp", "add_lane_options", "add_parser", "rejudge", "render_table", "run"]


def add_parser(sub: Any, database_default: str, results_default: Path) -> None:
    """Register ``realmodel`` on the ``python -m bench`` sub-parsers."""
    p = sub.add_parser(
        "realmodel",
        help="the service against llama-cpp-python's server and a real GGUF model (not in CI)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=DEFAULT_MODEL,
        help=f"a GGUF that PyPI packages carry (default {DEFAULT_MODEL})",
    )
    p.add_argument("--model-path", type=Path, help="any local GGUF instead of --model")
    p.add_argument(
        "--base-url",
        help="measure an OpenAI-compatible server that is already running (…/v1) instead of "
        "starting llama-cpp-python; with --llm-model",
    )
    p.add_argument("--llm-model", help="model name sent to the server (default: the alias)")
    p.add_argument("--bank-file", type=Path, default=BANK_FILE, help="the labelled bank")
    add_lane_options(p, database_default, results_default)
    p.add_argument(
        "--keep-database", action="store_true", help="leave the run's database for inspection"
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        help="cancel the replay after this many seconds (a model that rambles); the figures "
        "then cover what was done",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="run nothing: render a saved result again, judged against --bank-file's labels",
    )


@dataclasses.dataclass(frozen=True)
class LaneOptionsHelp:
    """What ``--help`` says of the lane's options that a command words its own way (this
    command's wording by default)."""

    env: str = (
        "any other setting for ingest and replay, repeatable "
        f"(the lane sets {', '.join(f'{k}={v}' for k, v in LANE_DEFAULTS.items())})"
    )
    response_format: str = (
        "CONSOLIDATION_LLM_RESPONSE_FORMAT for the run (default: the service's default)"
    )
    system_role: str = "CONSOLIDATION_LLM_SYSTEM_ROLE for the run (default: the service's default)"
    chat_format: str = (
        "llama-cpp-python --chat_format (default: the model's, else the GGUF's template)"
    )
    threads: str = "server threads (all cores)"
    server_arg: str | None = (
        "extra llama_cpp.server argument, repeatable (e.g. --server-arg=--n_batch=256)"
    )
    venv: str = "venv of the server, installed when missing (env BENCH_REALMODEL_VENV)"
    cache_dir: str = "downloaded wheels and assembled models (env BENCH_REALMODEL_CACHE)"


def add_lane_options(
    p: argparse.ArgumentParser,
    database_default: str,
    results_default: Path,
    wording: LaneOptionsHelp = LaneOptionsHelp(),
) -> None:
    """Add the options every command that runs the lane reads: the settings of ingest and replay
    (:func:`client_env`), the llama-cpp-python server (:func:`start_server`), the database and
    the results folder."""
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="CONSOLIDATION_X=VALUE",
        help=wording.env,
    )
    p.add_argument("--response-format", help=wording.response_format)
    p.add_argument("--system-role", help=wording.system_role)
    p.add_argument("--chat-format", help=wording.chat_format)
    p.add_argument("--n-ctx", type=int, default=8192, help="server context size (8192)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help=wording.threads)
    p.add_argument(
        "--server-arg", action="append", default=[], metavar="ARG", help=wording.server_arg
    )
    p.add_argument(
        "--fresh-context",
        action="store_true",
        help="evaluate every prompt from an empty context, so that each answer depends on its "
        "request alone (the server otherwise reuses the previous prompt's shared prefix, and "
        "answers on the edge flip with it); slower",
    )
    p.add_argument(
        "--venv",
        type=Path,
        default=Path(os.environ.get("BENCH_REALMODEL_VENV") or DEFAULT_HOME / "venv"),
        help=wording.venv,
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("BENCH_REALMODEL_CACHE") or DEFAULT_HOME),
        help=wording.cache_dir,
    )
    p.add_argument(
        "--database-url",
        default=database_default,
        help="a Postgres server where bench_* databases may be created (env BENCH_DATABASE_URL)",
    )
    p.add_argument("--results-dir", type=Path, default=results_default)


def rejudge(results: dict[str, Any], bank_file: Path) -> dict[str, Any]:
    """A saved result with its figures and judgement computed again (the labels or the rules
    may have changed since it was saved)."""
    seen = [
        ObservationSeen(tuple(o["scope"]), o["text"], tuple(o["sources"]))
        for o in results.get("observations") or []
    ]
    operation = results.get("operation") or {}
    perf = (operation.get("result") or {}).get("perf") or {}
    figures = (
        llm_figures(
            perf, results.get("events") or {}, completed=operation.get("status") == "completed"
        )
        if perf
        else None
    )
    return {**results, "figures": figures, "judgement": judge(load_bank(bank_file), seen)}


def client_env(args: argparse.Namespace) -> dict[str, str]:
    """The CONSOLIDATION_* settings ingest and replay run with (besides URLs set by the lane)."""
    env = dict(LANE_DEFAULTS)
    if args.response_format:
        env["CONSOLIDATION_LLM_RESPONSE_FORMAT"] = args.response_format
    if args.system_role:
        env["CONSOLIDATION_LLM_SYSTEM_ROLE"] = args.system_role
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("CONSOLIDATION_"):
            raise SystemExit(f"--env wants CONSOLIDATION_NAME=VALUE, got {item!r}")
        env[key] = value
    return env


def shown_env(env: Mapping[str, str]) -> dict[str, str]:
    """Settings as recorded: secrets masked, the caller's own CONSOLIDATION_* included."""
    inherited = {k: v for k, v in os.environ.items() if k.startswith("CONSOLIDATION_")}
    merged = {**inherited, **env}
    merged.pop("CONSOLIDATION_DATABASE_URL", None)
    return {
        k: ("***" if any(w in k for w in _SECRET_WORDS) else v) for k, v in sorted(merged.items())
    }


async def run(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    bank = load_bank(args.bank_file)
    env = client_env(args)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "machine": await report.machine(args.database_url),
        "bank": {
            "file": str(args.bank_file),
            "memories": len(bank.memories),
            "labels": len(bank.labels),
        },
    }
    logs = args.results_dir / "logs"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    with ExitStack() as stack:
        if args.base_url:
            server: dict[str, Any] = {
                "kind": "external",
                "url": args.base_url,
                "llm_model": args.llm_model or "default",
            }
            base_url, server_process = args.base_url, None
        else:
            server, server_process = start_server(args, logs, stamp, stack, log)
            base_url = server_process.url
        results["server"] = server
        env = {
            **env,
            "CONSOLIDATION_LLM_BASE_URL": base_url,
            "CONSOLIDATION_LLM_MODEL": server["llm_model"],
        }
        results["client_env"] = shown_env(env)
        databases = Databases(args.database_url)
        try:
            url = await databases.migrated(f"bench_realmodel_{uuid.uuid4().hex[:10]}")
            results.update(
                await consolidate_bank(
                    bank, url, env, logs / f"realmodel-{stamp}", args.deadline_s, log
                )
            )
        finally:
            if args.keep_database:
                log(f"database kept: {url}")
            else:
                await databases.drop_all()
        if server_process is not None:
            server["http_statuses"] = server_process.http_statuses()
    results["duration_s"] = round(time.perf_counter() - started, 1)
    return results


def start_server(
    args: argparse.Namespace, logs: Path, stamp: str, stack: ExitStack, log: Log
) -> tuple[dict[str, Any], LlamaServer]:
    """The lane's llama-cpp-python server for ``args`` (built and fetched from the cache),
    started under ``stack``: what it runs, as recorded in the results, and the server."""
    python, version = ensure_server_venv(args.venv, log, args.cache_dir / "install.log")
    spec = None if args.model_path else MODELS[args.model]
    model_path = args.model_path or fetch_model(MODELS[args.model], args.cache_dir, log)
    described = describe_model(model_path)
    chat_format = args.chat_format or (spec.chat_format if spec else None)
    if chat_format is None and described["chat_template"] is None:
        log("warning: the GGUF has no chat template and no --chat-format was given")
    alias = args.llm_model or (spec.name if spec else model_path.stem)
    process = LlamaServer(
        python,
        model_path,
        alias=alias,
        n_ctx=args.n_ctx,
        threads=args.threads,
        chat_format=chat_format,
        extra_args=args.server_arg,
        log_path=logs / f"realmodel-{stamp}-server.log",
        fresh_context=args.fresh_context,
    )
    log(f"starting llama_cpp.server {version} with {model_path.name} on {process.url}")
    stack.enter_context(process)
    log(f"server ready in {process.load_s:.1f} s")
    server = {
        "kind": "llama-cpp-python",
        "version": version,
        "url": process.url,
        "command": shlex.join(process.command),
        "fresh_context": process.fresh_context,
        "log": str(process.log_path),
        "load_s": round(process.load_s or 0.0, 1),
        "warm_up_s": round(process.warm_up_s or 0.0, 1),
        "llm_model": alias,
        "chat_format": chat_format or "the GGUF's chat template",
        "model": {
            **described,
            **(
                {"title": spec.title, "packages": list(spec.packages), "note": spec.note}
                if spec
                else {}
            ),
        },
    }
    return server, process


async def consolidate_bank(
    bank: Bank,
    url: str,
    env: Mapping[str, str],
    prefix: Path,
    deadline_s: float | None,
    log: Log,
) -> dict[str, Any]:
    """ingest + replay through the CLI, then read back what the operation left."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    child_env = {
        **os.environ,
        "CONSOLIDATION_LOG_LEVEL": "INFO",  # --env CONSOLIDATION_LOG_LEVEL=DEBUG logs decisions
        **env,
        "CONSOLIDATION_DATABASE_URL": url,
        "CONSOLIDATION_LOG_FORMAT": "json",
    }
    bank_file = prefix.with_name(prefix.name + "-bank.jsonl")
    bank_file.write_bytes(bank.jsonl())
    cli = [sys.executable, "-m", "consolidation.cli"]
    ingest = await asyncio.to_thread(
        subprocess.run,
        [*cli, "ingest", bank.bank_id, str(bank_file)],
        env=child_env,
        capture_output=True,
        check=False,
    )
    if ingest.returncode != 0:
        raise RuntimeError(f"consolidation ingest failed: {ingest.stderr.decode()[-2000:]}")
    log(ingest.stdout.decode().strip())
    log(f"consolidation replay {bank.bank_id} --json (a few minutes per LLM call on a CPU) …")
    replay_log = prefix.with_name(prefix.name + "-replay.log")
    started = time.perf_counter()
    with replay_log.open("wb") as err:
        stdout, returncode = await asyncio.to_thread(
            _replay, [*cli, "replay", bank.bank_id, "--json"], child_env, err, deadline_s, log
        )
    replay_s = time.perf_counter() - started
    lines = replay_log.read_bytes().splitlines()
    try:
        operation = orjson.loads(stdout)
    except orjson.JSONDecodeError:
        tail = b"\n".join(lines[-5:]).decode(errors="replace")
        operation = {"status": f"replay exited {returncode}", "error": tail, "result": None}
    counts, notable = log_events(lines)
    perf = (operation.get("result") or {}).get("perf") or {}
    observations = await _observations(url, bank)
    return {
        "ingest": ingest.stdout.decode().strip(),
        "replay_log": str(replay_log),
        "replay_s": round(replay_s, 1),
        "operation": operation,
        "figures": llm_figures(perf, counts, completed=operation.get("status") == "completed")
        if perf
        else None,
        "events": dict(sorted(counts.items())),
        "notable_events": notable[:100],
        "judgement": judge(bank, observations),
        "observations": [
            {"scope": list(o.scope), "text": o.text, "sources": list(o.sources)}
            for o in observations
        ],
    }


def _replay(
    command: list[str], env: Mapping[str, str], err: Any, deadline_s: float | None, log: Log
) -> tuple[bytes, int]:
    """Run ``replay``; past ``deadline_s`` cancel it as Ctrl-C would (the operation ends
    ``cancelled`` with what it applied, and its figures so far are still reported)."""
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL
    ) as process:
        try:
            stdout, _ = process.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            log(f"deadline of {deadline_s:g} s reached: cancelling the replay")
            process.send_signal(signal.SIGINT)
            stdout, _ = process.communicate()
        return stdout, process.returncode


async def _observations(url: str, bank: Bank) -> list[ObservationSeen]:
    key_of = {m.id: m.key for m in bank.memories}
    order = {m.key: i for i, m in enumerate(bank.memories)}
    conn = await db.connect(url)
    try:
        rows: list[store.ObservationRow] = []
        while True:
            page = await store.list_observations(
                conn, bank.bank_id, after=rows[-1].id if rows else None, limit=500
            )
            rows += page
            if len(page) < 500:
                break
    finally:
        await conn.close()
    seen = [
        ObservationSeen(
            scope=r.scope,
            text=r.text,
            sources=tuple(
                sorted(
                    (key_of.get(i, str(i)) for i in r.source_memory_ids),
                    key=lambda k: order.get(k, len(order)),
                )
            ),
        )
        for r in rows
    ]
    # Scope, then the bank order of the first memory cited: related observations end up together.
    return sorted(
        seen,
        key=lambda o: (o.scope, min((order.get(k, len(order)) for k in o.sources), default=0)),
    )
