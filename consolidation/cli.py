"""``consolidation`` command line: serve, migrate, ingest, replay, fake-llm.

A thin shell: every verb parses its arguments, then calls the same functions the service uses.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import orjson
import structlog

from consolidation import db
from consolidation.errors import ConfigError, ConsolidationError, ValidationError
from consolidation.logs import configure_logging
from consolidation.memories import NewMemory, bank_id_problems, content_id, parse_memory
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
    url = db.database_url(settings)
    before = db.current_revision(url)
    db.migrate_sync(url)
    after = db.current_revision(url)
    if before == after:
        print(f"schema already at {after}")
    else:
        print(f"schema migrated from {before or 'empty'} to {after}")
    return EXIT_OK


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
    memories: list[NewMemory] = []
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
            memories.append(parse_memory(obj, content_id(bank, line)))
        except ValidationError as exc:
            problems += [f"line {number}: {p}" for p in exc.problems]
    if problems:
        raise ValidationError(f"{path}: {len(problems)} problem(s), nothing was ingested", problems)
    return memories


async def _ingest(settings: Settings, bank: str, memories: list[NewMemory]) -> tuple[int, int]:
    from consolidation import store

    url = await db.prepare_database(settings)
    conn = await db.connect(url)
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
    problems = bank_id_problems(args.bank)
    if problems:
        raise CLIError(problems[0])
    memories = read_memories_file(args.bank, args.file)
    total, inserted = asyncio.run(_ingest(settings, args.bank, memories))
    print(
        f"ingested {total} memories into bank {args.bank!r} "
        f"({inserted} new, {total - inserted} already present)"
    )
    return EXIT_OK


# --- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consolidation",
        description="Consolidate an AI agent's memories into durable observations with an LLM.",
        epilog="Configuration is read from CONSOLIDATION_* environment variables (see README).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="apply database migrations")
    p.set_defaults(handler=cmd_migrate)

    p = sub.add_parser("ingest", help="ingest memories from a JSONL file (one object per line)")
    p.add_argument("bank", metavar="BANK")
    p.add_argument("file", metavar="FILE.jsonl", help="path, or - for standard input")
    p.set_defaults(handler=cmd_ingest)
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


if __name__ == "__main__":
    sys.exit(main())
