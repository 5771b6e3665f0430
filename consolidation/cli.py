"""``consolidation`` command line: serve, migrate, ingest, replay, forget, fake-llm.

A thin shell: every verb parses its arguments, then calls the same functions the service uses.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TextIO, cast

import orjson
import structlog

from consolidation import db, runtime
from consolidation.engine import RunSummary
from consolidation.errors import ConfigError, ConsolidationError, ValidationError
from consolidation.logs import configure_logging
from consolidation.memories import (
    NewMemory,
    bank_id_problems,
    content_id,
    parse_memory,
    repeated_id_problems,
)
from consolidation.perf import PerfLog
from consolidation.queue import Operation
from consolidation.settings import Settings, load_settings

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class CLIError(ConsolidationError):
    """A one-line message for the user and an exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# --- migrate --------------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    url = runtime.run(db.reach_database(settings), settings.event_loop)
    before = db.current_revision(url)
    db.migrate_sync(url)
    after = db.current_revision(url)
    if before == after:
        print(f"schema already at {after}")
    else:
        print(f"schema migrated from {before or 'empty'} to {after}")
    return EXIT_OK


def _check_bank_arg(bank: str) -> None:
    problems = bank_id_problems(bank)
    if problems:
        raise CLIError(problems[0])


# --- ingest ---------------------------------------------------------------------------------


def read_memories_file(bank: str, path: str) -> list[NewMemory]:
    """Parse a JSONL file of memories; any bad line rejects the whole file, listing every one.

    A line without ``id`` gets one derived from the bank and the line, so ingesting the same
    file twice (say, after an interruption) adds nothing the second time.
    """
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror}") from None
    memories: list[tuple[str, NewMemory]] = []
    problems: list[str] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"line {number}: not valid JSON ({exc})")
            continue
        try:
            memories.append((f"line {number}", parse_memory(obj, content_id(bank, line))))
        except ValidationError as exc:
            problems += [f"line {number}: {p}" for p in exc.problems]
    # Two identical lines without an id derive the same id, so they are caught here too.
    problems += repeated_id_problems(memories)
    if problems:
        raise ValidationError(f"{path}: {len(problems)} problem(s), nothing was ingested", problems)
    return [memory for _, memory in memories]


async def _ingest(settings: Settings, bank: str, memories: list[NewMemory]) -> tuple[int, int]:
    from consolidation import store

    url = await db.prepare_database(settings)
    conn = await db.connect(url, timeouts=db.Timeouts.for_lease(settings.lease_s))
    try:
        inserted = 0
        async with conn.transaction():
            for start in range(0, len(memories), 1000):
                result = await store.ingest_memories(conn, bank, memories[start : start + 1000])
                inserted += result.inserted
        return len(memories), inserted
    finally:
        await conn.close()


def cmd_ingest(args: argparse.Namespace, settings: Settings) -> int:
    _check_bank_arg(args.bank)
    memories = read_memories_file(args.bank, args.file)
    total, inserted = runtime.run(_ingest(settings, args.bank, memories), settings.event_loop)
    print(
        f"ingested {total} memories into bank {args.bank!r} "
        f"({inserted} new, {total - inserted} already present)"
    )
    return EXIT_OK


# --- replay ---------------------------------------------------------------------------------


class ProgressBar:
    """A one-line progress bar at the bottom of a terminal (stderr), drawn only when enabled.

    Log lines written to ``stream`` appear above the bar, which is drawn again below them, so
    neither breaks the other.
    """

    def __init__(self, enabled: bool, out: TextIO | None = None) -> None:
        self.enabled = enabled
        self._out = out or sys.stderr
        self._line = ""  # the bar as last drawn; "" before the first update and after close
        self._mid_line = False  # a log line was written in part: the cursor is not at a start
        self._lock = threading.Lock()  # stdlib loggers may write from other threads
        # typeshed's TextIO is a protocol of its own that io.TextIOBase does not declare.
        self.stream: TextIO = cast(TextIO, _AboveBar(self)) if enabled else self._out

    def update(self, summary: RunSummary) -> None:
        if not self.enabled:
            return
        total = max(summary.total, summary.processed, 1)
        width = 30
        filled = int(width * summary.processed / total)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {summary.processed}/{summary.total} "
            f"memories ({summary.failed} failed)"
        )
        with self._lock:
            self._line = line
            if not self._mid_line:
                self._out.write(f"\r{line}{CLEAR_TO_END}")
                self._out.flush()

    def write_above(self, text: str) -> None:
        """Write ``text`` where the bar is, then draw the bar again on the line below it."""
        with self._lock:
            if self._line and not self._mid_line:
                self._out.write(f"\r{CLEAR_TO_END}")
            self._out.write(text)
            self._mid_line = not text.endswith("\n")
            if self._line and not self._mid_line:
                self._out.write(self._line)
            self._out.flush()

    def close(self) -> None:
        """Leave the bar as last drawn and move below it."""
        with self._lock:
            if self._line:
                self._out.write("\n")
                self._out.flush()
            self._line = ""


# ANSI "erase to the end of the line": a shorter line drawn over a longer one leaves no tail.
CLEAR_TO_END = "\x1b[K"


class _AboveBar(io.TextIOBase):
    """The stream loggers write to while a progress bar is on the terminal."""

    def __init__(self, bar: ProgressBar) -> None:
        self._bar = bar

    def write(self, text: str) -> int:
        self._bar.write_above(text)
        return len(text)

    def isatty(self) -> bool:
        return True


async def _replay(settings: Settings, bank: str, reset: bool, bar: ProgressBar) -> Operation:
    from consolidation import queue, store
    from consolidation.engine import StopReason, StopSignal, run_operation
    from consolidation.runtime import foreground_pool, open_runtime

    size, warm = foreground_pool(settings.group_parallelism)
    async with open_runtime(settings, pool_size=size, kind="replay", warm=warm) as rt:
        if not await store.bank_exists(rt.pool, bank):
            raise CLIError(f"bank {bank!r} does not exist (ingest memories into it first)")
        if reset:
            await store.reset_bank(rt.pool, bank)
        try:
            lease = await queue.start_foreground(rt.pool, bank, rt.worker_id, settings.lease_s)
        except queue.BankBusy as exc:
            raise CLIError(str(exc), EXIT_FAILED) from None
        stop = StopSignal()

        def on_cancel(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            if payload == str(lease.operation_id):
                stop.set(StopReason.CANCEL)

        listener = await db.connect(rt.database_url, timeouts=rt.timeouts)
        await listener.add_listener(queue.NOTIFY_CANCEL, on_cancel)
        loop = asyncio.get_running_loop()
        # Ctrl-C cancels the operation like an API cancel: applied work is kept and marked.
        loop.add_signal_handler(signal.SIGINT, stop.set, StopReason.CANCEL)
        loop.add_signal_handler(signal.SIGTERM, stop.set, StopReason.CANCEL)
        try:
            await run_operation(
                rt.pool,
                lease,
                rt.llm,
                settings,
                stop=stop,
                on_progress=bar.update,
                embedder=rt.embedder,
            )
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            await listener.close()
            bar.close()
        return await queue.get_operation(rt.pool, lease.operation_id)


def describe_operation(op: Operation) -> str:
    """One human line about a finished operation."""
    result = op.result or {}
    perf = PerfLog.from_dict(result.get("perf", {}))
    actions = ", ".join(
        f"{getattr(perf, k)} {k}"
        for k in ("created", "updated", "merged", "multiple", "skipped", "failed")
    )
    line = (
        f"operation {op.id} {op.status}: {result.get('processed', 0)} memories processed "
        f"({actions}); {perf.llm_calls} LLM calls"
    )
    if op.started_at and op.finished_at:
        line += f"; {(op.finished_at - op.started_at).total_seconds():.1f} s"
    return line + (f"; error: {op.error}" if op.error and op.status != "completed" else "")


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    _check_bank_arg(args.bank)
    bar = ProgressBar(enabled=sys.stderr.isatty() and not args.json)
    if bar.enabled:
        configure_logging(settings.log_format, settings.log_level, stream=bar.stream)
    op = runtime.run(_replay(settings, args.bank, args.reset, bar), settings.event_loop)
    if args.json:
        sys.stdout.write(orjson.dumps(op.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(describe_operation(op))
    return EXIT_OK if op.status == "completed" else EXIT_FAILED


# --- forget ---------------------------------------------------------------------------------


def parse_memory_ids(values: Sequence[str]) -> list[uuid.UUID]:
    """Memory ids from the command line; every one that is not a UUID is named."""
    ids: list[uuid.UUID] = []
    bad: list[str] = []
    for value in values:
        try:
            ids.append(uuid.UUID(value))
        except ValueError:
            bad.append(value)
    if bad:
        raise CLIError(f"not a memory id (a UUID): {', '.join(repr(b) for b in bad)}")
    return ids


async def _forget(
    settings: Settings, bank: str, ids: list[uuid.UUID]
) -> dict[uuid.UUID, uuid.UUID]:
    from consolidation import store

    url = await db.prepare_database(settings)
    conn = await db.connect(url)
    try:
        return await store.request_forget(conn, bank, ids, max_attempts=settings.max_attempts)
    finally:
        await conn.close()


def cmd_forget(args: argparse.Namespace, settings: Settings) -> int:
    _check_bank_arg(args.bank)
    ids = parse_memory_ids(args.memory_ids)
    forgets = runtime.run(_forget(settings, args.bank, ids), settings.event_loop)
    for memory_id, operation_id in forgets.items():
        print(f"memory {memory_id}: forgotten by operation {operation_id}")
    print(
        "a worker (consolidation serve) deletes them and re-derives what they supported; "
        "follow GET /v1/operations/<operation id>"
    )
    return EXIT_OK


# --- serve and fake-llm ---------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from consolidation.service import serve

    if args.no_api and args.no_worker:
        raise CLIError("--no-api and --no-worker together leave nothing to run")
    return runtime.run(
        serve(settings, api=not args.no_api, worker=not args.no_worker), settings.event_loop
    )


def cmd_fake_llm(args: argparse.Namespace, settings: Settings) -> int:
    from consolidation.testing.fake_llm import FakeLLMConfig, serve

    if not 0.0 <= args.fail_rate <= 1.0:
        raise CLIError("--fail-rate must be between 0 and 1")
    try:
        config = FakeLLMConfig(
            latency_ms=args.latency_ms,
            jitter_ms=args.jitter_ms,
            latency_median_ms=args.latency_median_ms,
            latency_p99_ms=args.latency_p99_ms,
            ttft_ms=args.ttft_ms,
            per_token_ms=args.per_token_ms,
            fail_rate=args.fail_rate,
            fail_status=args.fail_status,
            retry_after_s=args.retry_after,
            pad_bytes=args.pad_bytes,
            api_key=args.api_key,
            seed=args.seed,
            dialect=args.dialect,
            honour_max_tokens=not args.ignore_max_tokens,
            think=args.think,
            reasoning_content=args.reasoning_content,
            drop_system=args.drop_system,
            envelope=args.envelope,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        serve(args.host, args.port, config)
    except OSError as exc:
        raise CLIError(f"cannot listen on {args.host}:{args.port} ({exc.strerror})") from None
    return EXIT_OK


# --- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consolidation",
        description="Consolidate an AI agent's memories into durable observations with an LLM.",
        epilog="Configuration is read from CONSOLIDATION_* environment variables (see README).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the HTTP API and the worker (until SIGTERM/SIGINT)")
    p.add_argument("--no-api", action="store_true", help="run only the worker")
    p.add_argument("--no-worker", action="store_true", help="run only the HTTP API")
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("migrate", help="apply database migrations")
    p.set_defaults(handler=cmd_migrate)

    p = sub.add_parser("ingest", help="ingest memories from a JSONL file (one object per line)")
    p.add_argument("bank", metavar="BANK")
    p.add_argument("file", metavar="FILE.jsonl", help="path, or - for standard input")
    p.set_defaults(handler=cmd_ingest)

    p = sub.add_parser(
        "replay", help="consolidate one bank in the foreground, to completion (Ctrl-C cancels)"
    )
    p.add_argument("bank", metavar="BANK")
    p.add_argument(
        "--reset",
        action="store_true",
        help="first clear the bank's markers, outcomes and observations",
    )
    p.add_argument("--json", action="store_true", help="print the final operation as JSON")
    p.set_defaults(handler=cmd_replay)

    p = sub.add_parser(
        "forget",
        help="forget memories of a bank and what was derived from them (all or nothing)",
    )
    p.add_argument("bank", metavar="BANK")
    p.add_argument("memory_ids", metavar="MEMORY_ID", nargs="+")
    p.set_defaults(handler=cmd_forget)

    p = sub.add_parser(
        "fake-llm", help="serve a fake OpenAI-compatible LLM (offline policy) for tests and load"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument(
        "--latency-median-ms",
        type=float,
        default=0.0,
        help="a real server's heavy tail instead of --latency-ms/--jitter-ms: lognormal latency "
        "with this median (and --latency-p99-ms)",
    )
    p.add_argument("--latency-p99-ms", type=float, default=0.0, help="the lognormal's p99")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="time to the first token, added")
    p.add_argument(
        "--per-token-ms", type=float, default=0.0, help="added per completion token of the answer"
    )
    p.add_argument(
        "--fail-rate", type=float, default=0.0, help="fraction answered with --fail-status"
    )
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument(
        "--retry-after", type=float, default=None, help="Retry-After seconds on failures"
    )
    p.add_argument("--pad-bytes", type=int, default=0, help="whitespace added to every answer")
    p.add_argument("--api-key", default=None, help="require this bearer key")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--dialect",
        default="openai",
        help="the server to imitate: openai (default), llama-cpp-python, no-schema or "
        "json-object-only (how each treats response_format: see consolidation/testing/fake_llm.py)",
    )
    p.add_argument(
        "--ignore-max-tokens", action="store_true", help="never cut an answer at max_tokens"
    )
    p.add_argument("--think", action="store_true", help="put a <think> block before answers")
    p.add_argument(
        "--reasoning-content", action="store_true", help="add reasoning_content to answers"
    )
    p.add_argument(
        "--drop-system", action="store_true", help="play a chat template that drops system"
    )
    p.add_argument(
        "--envelope",
        default="completion",
        help="completion (default); html or no-choices answer 200 with a body that is not one",
    )
    p.set_defaults(handler=cmd_fake_llm)
    return parser


def _fail(message: str, code: int) -> NoReturn:
    print(f"consolidation: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE)
    configure_logging(settings.log_format, settings.log_level)
    handler: Callable[[argparse.Namespace, Settings], int] = args.handler
    try:
        return handler(args, settings)
    except ValidationError as exc:
        print(f"consolidation: error: {exc.args[0]}", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_USAGE
    except CLIError as exc:
        _fail(str(exc), exc.code)
    except ConsolidationError as exc:
        _fail(str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def entry() -> int:
    """The ``consolidation`` command: :func:`main` in a process of its own, its collector tuned
    for a long run (:func:`consolidation.runtime.tune_gc`; not in :func:`main`, which tests
    call in their own process)."""
    runtime.tune_gc()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
