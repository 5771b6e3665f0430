"""structlog set-up: JSON lines by default, a readable console format on a terminal.

The standard library's loggers (asyncpg, uvicorn, alembic, aiohttp, asyncio, warnings) go
through the same renderer, so in JSON mode every line a process writes to stderr is one JSON
object, tracebacks included (as structured ``exception`` frames, without local variables).
"""

from __future__ import annotations

import logging
import sys
import threading
from types import TracebackType
from typing import Any, TextIO

import orjson
import structlog


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure_logging(
    fmt: str | None = None, level: str = "INFO", stream: TextIO | None = None
) -> None:
    """Configure structlog and stdlib logging to write to ``stream`` (stderr when None); ``fmt``
    None picks console on a TTY. Calling it again replaces the previous configuration."""
    stream = stream or sys.stderr
    if fmt is None:
        fmt = "console" if stream.isatty() else "json"
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    renderer: Any
    tracebacks: list[Any] = []
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer()
    else:
        # Structured frames without their local variables: library frames hold passwords
        # (asyncpg's connect) and keys, which must not reach the logs.
        tracebacks = [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        ]
        renderer = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # WriteLogger hands the stream each line and its newline in one write(); print() makes
        # two system calls of it, between which another process sharing the stream (replicas
        # behind one pipe) or the stdlib handler below could put a line of its own.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                timestamper,
                *tracebacks,
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    # Libraries say much at INFO (uvicorn, alembic, pgserver): only their warnings and errors.
    root.setLevel(max(logging.WARNING, logging.getLevelName(level)))
    logging.captureWarnings(True)
    if fmt == "json":
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(
    kind: type[BaseException], error: BaseException, tb: TracebackType | None
) -> None:
    structlog.get_logger("consolidation").critical("uncaught_exception", exc_info=(kind, error, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        _log_uncaught(args.exc_type, args.exc_value, args.exc_traceback)
