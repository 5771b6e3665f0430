"""The database work of an engine run alone: the limit the engine's throughput is measured against.

:class:`Recorder` (installed in the engine's child process) writes down every statement of the
run that touches the bank — each wave's fetch, each pass's recall and apply (with the answer the
fake gave, already turned into writes), each wave's markers — with the task that made it (the
engine names its tasks ``wave-N`` and ``wave-N-group-I``). :func:`replay` sends the same
statements to a fresh clone of the same bank with no engine, no LLM and no HTTP: the same
functions of ``store`` on the same pool settings, groups in parallel up to the group parallelism,
each group's statements in order, a group behind the earlier groups that write one of its scopes,
and each wave's markers once its groups are done. Engine memories/s divided by replay
memories/s is the fraction of the database's own pace the engine reaches; the replay's CPU (its
own and its Postgres backends') says what of the gap is the CPU the engine and the fake LLM add
and what is cores the engine run leaves idle.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import orjson

from consolidation import db, queue, runtime, store
from consolidation.queue import Lease
from consolidation.scopes import Scope


@dataclass
class _Wave:
    fetch: dict[str, Any]
    memory_ids: set[uuid.UUID] = field(default_factory=set)
    groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    markers: dict[str, Any] | None = None


class Recorder:
    """Wraps ``store.fetch_wave``, ``store.recall_many``, ``store.apply_pass`` and
    ``store.commit_wave_markers`` in this process while :meth:`install` is in effect."""

    def __init__(self) -> None:
        self.waves: list[_Wave] = []
        self._originals: dict[str, Callable[..., Awaitable[Any]]] = {}

    def install(self) -> None:
        for name in ("fetch_wave", "recall_many", "apply_pass", "commit_wave_markers"):
            original = getattr(store, name)
            self._originals[name] = original
            setattr(store, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(store, name, original)
        self._originals.clear()

    def _wrap(
        self, name: str, original: Callable[..., Awaitable[Any]]
    ) -> Callable[..., Awaitable[Any]]:
        async def recorded(*args: Any, **kwargs: Any) -> Any:
            self._record(name, args, kwargs)
            result = await original(*args, **kwargs)
            if name == "fetch_wave":
                self.waves[-1].memory_ids = {m.id for m in result}
            return result

        return recorded

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        task = asyncio.current_task()
        where = task.get_name() if task is not None else ""
        if name == "fetch_wave":
            _, bank, after, limit, _ = args
            cursor = None if after is None else [after[0].isoformat(), str(after[1])]
            self.waves.append(_Wave({"bank": bank, "after": cursor, "limit": limit}))
            return
        if name == "commit_wave_markers":
            # Written from a shielded task of its own: the wave is the one of its memories.
            _, _, consolidated, failed = args
            marked = [*consolidated, *failed]
            if marked:
                wave = next(w for w in self.waves if marked[0] in w.memory_ids)
                wave.markers = {"consolidated": list(consolidated), "failed": dict(failed)}
            return
        wave = self.waves[int(where.split("-")[1]) - 1]
        if name == "recall_many":
            _, _, requests = args
            wave.groups.setdefault(where, []).append(
                {"recall": {"scope": requests[0].scope, "requests": list(requests)}}
            )
        else:
            _, _, write, recall_next = args
            wave.groups.setdefault(where, []).append(
                {"apply": write, "next": recall_next, "embeddings": kwargs.get("embeddings", False)}
            )

    def dump(self) -> bytes:
        return orjson.dumps(
            [
                {"fetch": w.fetch, "groups": w.groups, "markers": w.markers}
                for w in self.waves
                if w.groups or w.markers  # the last fetch found nothing
            ],
            option=orjson.OPT_NON_STR_KEYS,
            default=db.dumps_default,
        )


class CPUMeter(Protocol):
    """CPU seconds of the Postgres backends serving a pool, between :meth:`start` and
    :meth:`stop` (bench/perf/child.py's ``_BackendCPU``)."""

    def start(self) -> None: ...

    async def stop(self) -> float: ...


def _write(raw: dict[str, Any], operation_id: uuid.UUID) -> store.PassWrite:
    return store.PassWrite(
        bank_id=raw["bank_id"],
        scope=tuple(raw["scope"]),
        operation_id=operation_id,
        observations=tuple(
            store.ObservationWrite(
                tuple(uuid.UUID(i) for i in o["ids"]),
                o["text"],
                tuple(uuid.UUID(i) for i in o["memory_ids"]),
                o["create"],
                o.get("embedding"),
            )
            for o in raw["observations"]
        ),
        outcomes=tuple(
            store.Outcome(
                uuid.UUID(o["memory_id"]),
                o["action"],
                tuple(uuid.UUID(i) for i in o["observation_ids"]),
            )
            for o in raw["outcomes"]
        ),
    )


def _recall_request(raw: dict[str, Any] | None) -> store.RecallRequest | None:
    if raw is None:
        return None
    vectors = raw.get("fact_vectors")
    return store.RecallRequest(
        tuple(raw["scope"]),
        tuple(raw["fact_texts"]),
        raw["limit"],
        None if vectors is None else tuple(vectors),
    )


async def replay(
    database_url: str,
    recording: bytes,
    group_parallelism: int,
    backends: CPUMeter | None = None,
) -> dict[str, Any]:
    """Send a recorded run's statements to ``database_url`` (a fresh clone of the same bank);
    returns the wall time, how many memories its markers marked and the CPU seconds this
    process spent sending them (with ``backends``, the pool's backends' too)."""
    waves = orjson.loads(recording)
    # Warm, as the engine's pool is: neither pays for new sessions.
    size, warm = runtime.foreground_pool(group_parallelism)
    pool = await db.create_pool(database_url, min_size=warm, max_size=size)
    await store.warm(pool, warm, hybrid=_hybrid(waves))
    slots = asyncio.Semaphore(group_parallelism)
    last_writer: dict[Scope, asyncio.Task[None]] = {}
    try:
        lease = await queue.start_foreground(pool, waves[0]["fetch"]["bank"], "dbonly", 600)
        if backends is not None:
            backends.start()
        cpu_before = time.process_time()
        started = time.perf_counter()
        wave_tasks = []
        for wave in waves:
            fetch = wave["fetch"]
            after = fetch["after"]
            cursor = (
                None if after is None else (datetime.fromisoformat(after[0]), uuid.UUID(after[1]))
            )
            await store.fetch_wave(pool, fetch["bank"], cursor, fetch["limit"], None)
            groups = []
            for calls in wave["groups"].values():
                scopes = {
                    tuple(c["recall"]["scope"] if "recall" in c else c["apply"]["scope"])
                    for c in calls
                }
                before = {last_writer[s] for s in scopes if s in last_writer}
                task = asyncio.create_task(_group(pool, lease, slots, calls, before))
                for scope in scopes:
                    last_writer[scope] = task
                groups.append(task)
            wave_tasks.append(asyncio.create_task(_markers(pool, lease, groups, wave["markers"])))
        marked = sum(await asyncio.gather(*wave_tasks))
        wall = time.perf_counter() - started
        driver_cpu = time.process_time() - cpu_before
        backend_cpu = None if backends is None else await backends.stop()
        await queue.finish(pool, lease, "completed")
    finally:
        await pool.close()
    return {
        "status": "completed",
        "wall_s": wall,
        "memories": marked,
        "memories_per_s": marked / wall if wall else 0.0,
        "driver_cpu_s": driver_cpu,
        "postgres_cpu_s": backend_cpu,
    }


def _hybrid(waves: list[dict[str, Any]]) -> bool:
    """Whether the recorded run recalled with embeddings."""
    return any(
        call.get("embeddings", False)
        for wave in waves
        for calls in wave["groups"].values()
        for call in calls
    )


async def _group(
    pool: Any,
    lease: Lease,
    slots: asyncio.Semaphore,
    calls: list[dict[str, Any]],
    before: set[asyncio.Task[None]],
) -> None:
    if before:
        await asyncio.wait(before)
    async with slots:
        for call in calls:
            if "recall" in call:
                requests = [_recall_request(r) for r in call["recall"]["requests"]]
                await store.recall_many(pool, lease.bank_id, [r for r in requests if r])
            else:
                write = _write(call["apply"], lease.operation_id)
                await store.apply_pass(
                    pool,
                    lease,
                    write,
                    _recall_request(call["next"]),
                    embeddings=call["embeddings"],
                )


async def _markers(
    pool: Any, lease: Lease, groups: list[asyncio.Task[None]], markers: dict[str, Any] | None
) -> int:
    await asyncio.gather(*groups)
    if markers is None:
        return 0
    consolidated = [uuid.UUID(m) for m in markers["consolidated"]]
    failed = {uuid.UUID(m): reason for m, reason in markers["failed"].items()}
    await store.commit_wave_markers(pool, lease, consolidated, failed)
    return len(consolidated) + len(failed)
