"""Build the long-lived parts from settings: database pool and LLM client. Shared by the CLI
verbs and the service so both run on identical parts."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import importlib.util
import os
import socket
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
import structlog

from consolidation import db, store
from consolidation.errors import ConfigError
from consolidation.llm.client import Consolidator, HTTPConsolidator, OfflineConsolidator
from consolidation.llm.embeddings import Embedder, build_embedder, require_vector_storage
from consolidation.llm.transport import options_from
from consolidation.settings import Settings

log = structlog.get_logger(__name__)

T = TypeVar("T")

# The collector's thresholds for a long-running process: the youngest generation every 10,000
# allocations (CPython: 700), the middle one every 50 of those, the oldest every 100 of these.
GC_THRESHOLDS = (10_000, 50, 100)


def tune_gc() -> None:
    """Fewer cyclic garbage collections in a long-running process (docs/benchmarks.md, "What
    was tried"): what start-up built (modules, classes, settings: tens of thousands of objects)
    is frozen out of every collection, and collections come later (:data:`GC_THRESHOLDS`). What
    a pass allocates is nearly all freed by reference counting the moment it is dropped; the
    collections mostly walked the same long-lived objects again, 10 % of the engine's CPU at
    zero latency."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def event_loop_name(choice: str) -> str:
    """The loop ``CONSOLIDATION_EVENT_LOOP`` asks for: ``uvloop`` or ``asyncio``."""
    if choice == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    if choice == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ConfigError(
            "CONSOLIDATION_EVENT_LOOP=uvloop but uvloop is not installed: pip install uvloop, "
            "or set it to auto or asyncio"
        )
    return choice


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """Run ``main`` to completion on a new event loop of the chosen kind.

    uvloop is the default where it is installed (every platform but Windows): the engine needs
    less CPU on it (docs/benchmarks.md, "What was tried").
    """
    try:
        name = event_loop_name(choice)
    except ConfigError:
        main.close()
        raise
    if name == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def build_consolidator(settings: Settings) -> Consolidator:
    """The HTTP client when an LLM URL is configured, else the offline consolidator (warned)."""
    if settings.llm_base_url is None:
        how = (
            "the embeddings' cosine and shared words"
            if settings.embeddings_base_url
            else "lexical similarity"
        )
        log.warning(
            "offline_consolidator",
            message="CONSOLIDATION_LLM_BASE_URL is not set: using the built-in offline "
            f"consolidator ({how}, no LLM). Set it to use a real model.",
        )
        return OfflineConsolidator()
    return HTTPConsolidator(
        base_url=settings.llm_base_url,
        model=settings.llm_model,
        api_key=settings.llm_api_key.get_secret_value() if settings.llm_api_key else None,
        response_format=settings.llm_response_format,
        max_tokens=settings.llm_max_tokens,
        system_role=settings.llm_system_role,
        hedge_quantile=settings.llm_hedge_quantile,
        **options_from(settings),
    )


def worker_identity(kind: str, hostname: str | None = None, pid: int | None = None) -> str:
    """A worker id that says where it runs, ``kind:host:pid``, and that Postgres keeps unchanged
    as the ``application_name`` of its sessions (printable ASCII, at most 63 bytes): leases and
    sessions must carry the same id for a stalled worker to be fenced.

    A host name that does not fit is cut and tagged with a hash of the whole name, so two long
    names that share a beginning still give two ids.
    """
    host = socket.gethostname() if hostname is None else hostname
    suffix = f":{os.getpid() if pid is None else pid}"
    room = db.APPLICATION_NAME_MAX - len(kind) - 1 - len(suffix)
    if not db.is_application_name(host) or len(host) > room:
        digest = hashlib.sha256(host.encode("utf-8", "surrogateescape")).hexdigest()[:8]
        printable = "".join(c if " " <= c <= "~" else "?" for c in host)
        host = f"{printable[: max(0, room - 9)]}~{digest}"
    worker_id = f"{kind}:{host}{suffix}"
    if not db.is_application_name(worker_id):  # only a kind far too long gets here
        raise ValueError(f"worker kind {kind!r} leaves no room for a host name")
    return worker_id


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    database_url: str
    pool: asyncpg.Pool
    llm: Consolidator
    worker_id: str
    timeouts: db.Timeouts
    embedder: Embedder | None = None  # set with CONSOLIDATION_EMBEDDINGS_BASE_URL


def foreground_pool(group_parallelism: int) -> tuple[int, int]:
    """The pool of an operation run in the foreground (``replay``, and the benchmark's engine
    and its database-only replay, which run it alike): its size, and how many of its
    connections are opened and warmed before the operation starts — one per group slot, and
    two for the waves' fetches and markers. A process that runs one operation and exits has no
    reason to open them lazily."""
    return group_parallelism + 4, group_parallelism + 2


@asynccontextmanager
async def open_runtime(
    settings: Settings, *, pool_size: int | None = None, kind: str = "worker", warm: int = 0
) -> AsyncIterator[Runtime]:
    """Database (migrated), LLM client and embeddings client (when configured, once the database
    can store vectors), closed in reverse order on exit.

    The pool's sessions are named after this process's worker id (``kind:host:pid``), the same
    id its leases carry, so a stalled process can be fenced by ending its sessions. Every
    statement is bounded by the lease (:class:`db.Timeouts`); idle connections are released
    down to one within ``db.POOL_IDLE_S``; with ``warm``, that many are opened at once and
    made ready for an operation (:func:`store.warm`) before this yields, and kept.
    """
    async with AsyncExitStack() as stack:
        url = await db.prepare_database(settings)
        size = pool_size or max(10, settings.group_parallelism * settings.worker_concurrency + 4)
        worker_id = worker_identity(kind)
        timeouts = db.Timeouts.for_lease(settings.lease_s)
        warm = min(warm, size)
        pool = await db.create_pool(
            url,
            min_size=max(1, warm),
            max_size=size,
            application_name=worker_id,
            timeouts=timeouts,
        )
        stack.push_async_callback(_close_pool, pool)
        llm = build_consolidator(settings)
        stack.push_async_callback(llm.aclose)
        embedder = build_embedder(settings)
        if embedder is not None:
            stack.push_async_callback(embedder.aclose)
            async with pool.acquire() as conn:
                await require_vector_storage(conn)
        if warm:
            await store.warm(pool, warm, hybrid=embedder is not None)
        yield Runtime(settings, url, pool, llm, worker_id, timeouts, embedder)


async def _close_pool(pool: asyncpg.Pool) -> None:
    """Close the pool; a database that does not answer (each close is bounded by the lease)
    gets its connections dropped instead, which must not turn a clean shutdown into a crash."""
    try:
        await pool.close()
    except Exception as exc:
        log.warning("database_pool_close_failed", error=repr(exc))
        pool.terminate()
