"""``python -m bench quality``: every labelled bank through the service's own entry points
(``consolidation ingest``, then ``consolidation replay --json`` on a fresh migrated database),
against one of four deciders, judged per bank beside the trivial baselines.

    --oracle          the oracle server (bench/quality/oracle.py): what the pipeline delivers
    --offline         the built-in offline consolidator (no CONSOLIDATION_LLM_BASE_URL)
    --model NAME      the real-model lane's llama-cpp-python server with a local GGUF
    --base-url URL    any OpenAI-compatible endpoint (with --llm-model)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

from bench.infra import Databases, pgvector_server, stop_process
from bench.perf import report, tokens
from bench.quality.banks import DEFAULT_BANK_FILES, QualityBank, load_banks
from bench.quality.judge import MemoryFate, StoredObservation, baselines, judge_quality
from bench.realmodel import run as realmodel
from bench.realmodel.server import MODELS
from consolidation import db

Log = Callable[[str], None]
# Small waves and batches, so that a label's facts land in different batches and waves and the
# engine's hand-over between them (recall of what an earlier batch wrote) is what is measured.
QUALITY_DEFAULTS = {
    "CONSOLIDATION_WAVE_SIZE": "16",
    "CONSOLIDATION_LLM_BATCH_SIZE": "8",
}
MODES = ("oracle", "offline", "model", "endpoint")


def add_parser(sub: Any, database_default: str, results_default: Path) -> None:
    """Register ``quality`` on the ``python -m bench`` sub-parsers."""
    p = sub.add_parser(
        "quality",
        help="observation quality on labelled banks: oracle, offline, a local model or any "
        "endpoint",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--oracle", action="store_true", help="the oracle server (perfect model)")
    what.add_argument("--offline", action="store_true", help="the built-in offline consolidator")
    what.add_argument("--model", choices=sorted(MODELS), help="a local GGUF through the lane")
    what.add_argument("--model-path", type=Path, help="any local GGUF through the lane")
    what.add_argument("--base-url", help="an OpenAI-compatible endpoint (…/v1)")
    what.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="run nothing: render a saved result again, judged against the banks' current "
        "labels (with --markdown, as docs/quality.md's tables)",
    )
    p.add_argument("--markdown", action="store_true", help="with --report: markdown tables")
    p.add_argument("--llm-model", help="model name sent to the server (default: the alias)")
    p.add_argument(
        "--bank-file",
        type=Path,
        action="append",
        default=[],
        help="a labelled bank, repeatable (default: the lane's bank and bench/quality/banks/)",
    )
    realmodel.add_lane_options(
        p,
        database_default,
        results_default,
        realmodel.LaneOptionsHelp(
            env="any setting for ingest and replay, repeatable, e.g. CONSOLIDATION_LLM_CONTRACT=v2 "
            f"(the run sets {', '.join(f'{k}={v}' for k, v in QUALITY_DEFAULTS.items())} and the "
            "lane's timeouts unless told otherwise)",
            response_format="CONSOLIDATION_LLM_RESPONSE_FORMAT for the run",
            system_role="CONSOLIDATION_LLM_SYSTEM_ROLE for the run",
            chat_format="llama-cpp-python --chat_format (lane only)",
            threads="server threads",
            server_arg=None,
            venv="the lane's server venv (env BENCH_REALMODEL_VENV)",
            cache_dir="the lane's wheels and models (env BENCH_REALMODEL_CACHE)",
        ),
    )
    p.add_argument("--keep-database", action="store_true", help="leave each bank's database")
    p.add_argument(
        "--deadline-s", type=float, help="cancel a bank's replay after this many seconds"
    )


def mode_of(args: argparse.Namespace) -> str:
    if args.oracle:
        return "oracle"
    if args.offline:
        return "offline"
    return "endpoint" if args.base_url else "model"


def run_env(args: argparse.Namespace, mode: str) -> dict[str, str]:
    """The CONSOLIDATION_* settings of ingest and replay (URLs of the decider come later)."""
    env = {**QUALITY_DEFAULTS, **realmodel.client_env(args)}
    if mode == "offline" and "CONSOLIDATION_LLM_BASE_URL" in {**os.environ, **env}:
        raise SystemExit("--offline: unset CONSOLIDATION_LLM_BASE_URL first")
    return env


async def run(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    banks = load_banks(tuple(args.bank_file) or DEFAULT_BANK_FILES)
    mode = mode_of(args)
    env = run_env(args, mode)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "mode": mode,
        "machine": await report.machine(args.database_url),
    }
    logs = args.results_dir / "logs"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    with ExitStack() as stack:
        if mode == "oracle":
            url = stack.enter_context(oracle_server(banks, logs / f"quality-{stamp}"))
            server: dict[str, Any] = {"kind": "oracle", "url": url, "llm_model": "oracle"}
        elif mode == "offline":
            server = {"kind": "offline consolidator", "url": None, "llm_model": None}
        elif mode == "endpoint":
            server = {
                "kind": "external",
                "url": args.base_url,
                "llm_model": args.llm_model or "default",
            }
        else:
            server, process = realmodel.start_server(args, logs, stamp, stack, log)
            server["url"] = process.url
        if mode in ("model", "endpoint"):
            # Written down on the way through, so the prompts split as an oracle run's do.
            server["upstream_url"] = server["url"]
            server["url"] = stack.enter_context(
                recorder_server(server["url"], logs / f"quality-{stamp}")
            )
        if server["url"] is not None:
            env = {
                **env,
                "CONSOLIDATION_LLM_BASE_URL": server["url"],
                "CONSOLIDATION_LLM_MODEL": server["llm_model"],
            }
        results["server"] = server
        results["client_env"] = realmodel.shown_env(env)
        async with _database_server(args.database_url, env, log) as admin_url:
            results["banks"] = {}
            for qbank in banks:
                log(f"bank {qbank.name}: {len(qbank.bank.memories)} memories")
                results["banks"][qbank.name] = await _run_bank(
                    qbank, admin_url, env, logs / f"quality-{stamp}-{qbank.name}", args, log
                )
        if mode == "oracle":
            _add_token_split(results["banks"], _transcript(logs / f"quality-{stamp}"))
        elif mode != "offline":
            _add_token_split(results["banks"], _calls(logs / f"quality-{stamp}"))
        if mode == "model":
            server["http_statuses"] = process.http_statuses()
    results["duration_s"] = round(time.perf_counter() - started, 1)
    return results


@contextlib.asynccontextmanager
async def _database_server(url: str, env: Mapping[str, str], log: Log) -> AsyncIterator[str]:
    """The Postgres server of the run: with embeddings configured it needs pgvector."""
    if env.get("CONSOLIDATION_EMBEDDINGS_BASE_URL") or os.environ.get(
        "CONSOLIDATION_EMBEDDINGS_BASE_URL"
    ):
        async with pgvector_server(url, log) as vector_url:
            yield vector_url
    else:
        yield url


async def _run_bank(
    qbank: QualityBank,
    admin_url: str,
    env: Mapping[str, str],
    prefix: Path,
    args: argparse.Namespace,
    log: Log,
) -> dict[str, Any]:
    databases = Databases(admin_url)
    url = await databases.migrated(f"bench_quality_{uuid.uuid4().hex[:10]}")
    try:
        done = await realmodel.consolidate_bank(qbank.bank, url, env, prefix, args.deadline_s, log)
        observations, fates = await read_run(url, qbank)
    finally:
        if args.keep_database:
            log(f"database kept: {url}")
        else:
            await databases.drop_all()
    return {
        "file": str(qbank.path),
        "held_out": qbank.held_out,
        "memories": len(qbank.bank.memories),
        "labels": len(qbank.bank.labels),
        **done,
        "judgement": judge_quality(qbank, observations, fates),
        "baselines": baselines(qbank),
        "observations": [
            {
                "scope": list(o.scope),
                "text": o.text,
                "sources": list(o.sources),
                "prior_texts": list(o.prior_texts),
            }
            for o in observations
        ],
        "fates": [dataclasses.asdict(f) for f in fates],
    }


def rejudge(saved: dict[str, Any], bank_files: Sequence[Path] = ()) -> dict[str, Any]:
    """A saved run judged again against its banks' current labels and the current rules (the
    labels or the judge may have changed since). A bank whose labels are not found, or saved
    without its memories' fates, keeps the judgement it was saved with."""
    banks = {b.name: b for b in load_banks(tuple(bank_files) or DEFAULT_BANK_FILES)}
    for name, result in saved.get("banks", {}).items():
        qbank = banks.get(name)
        if qbank is None or "fates" not in result:
            continue
        observations = [
            StoredObservation(
                tuple(o["scope"]), o["text"], tuple(o["sources"]), tuple(o["prior_texts"])
            )
            for o in result["observations"]
        ]
        fates = [
            MemoryFate(
                key=f["key"],
                actions=tuple(f["actions"]),
                failed_reason=f["failed_reason"],
                consolidated=f["consolidated"],
                skip_reason=f.get("skip_reason"),
            )
            for f in result["fates"]
        ]
        result["judgement"] = judge_quality(qbank, observations, fates)
        result["baselines"] = baselines(qbank)
    return saved


async def read_run(
    url: str, qbank: QualityBank
) -> tuple[list[StoredObservation], list[MemoryFate]]:
    """The observations a run left (with the texts they replaced or absorbed, from
    observation_history) and each memory's fate (markers and consolidation_outcomes)."""
    key_of = {m.id: m.key for m in qbank.bank.memories}
    order = {m.key: i for i, m in enumerate(qbank.bank.memories)}
    bank_id = qbank.name
    conn = await db.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT o.id, o.scope, o.text, ARRAY(SELECT s.memory_id FROM observation_sources s"
            " WHERE s.observation_id = o.id) AS sources"
            " FROM observations o WHERE o.bank_id = $1",
            bank_id,
        )
        history = await conn.fetch(
            "SELECT observation_id, action, previous_text, merged_into FROM observation_history"
            " WHERE bank_id = $1 ORDER BY id",
            bank_id,
        )
        outcomes = await conn.fetch(
            "SELECT c.memory_id, to_jsonb(c) AS row FROM consolidation_outcomes c"
            " JOIN memories m ON m.id = c.memory_id WHERE m.bank_id = $1",
            bank_id,
        )
        markers = await conn.fetch(
            "SELECT id, consolidated_at IS NOT NULL AS consolidated, consolidation_failed_reason,"
            " consolidation_failed_at IS NOT NULL AS failed FROM memories WHERE bank_id = $1",
            bank_id,
        )
    finally:
        await conn.close()
    replaced: dict[uuid.UUID, list[str]] = {}
    absorbed: dict[uuid.UUID, list[uuid.UUID]] = {}
    for h in history:
        replaced.setdefault(h["observation_id"], []).append(h["previous_text"])
        if h["action"] == "merged_away" and h["merged_into"] is not None:
            absorbed.setdefault(h["merged_into"], []).append(h["observation_id"])

    def prior(observation_id: uuid.UUID, seen: frozenset[uuid.UUID]) -> Iterator[str]:
        yield from replaced.get(observation_id, ())
        for other in absorbed.get(observation_id, ()):
            if other not in seen:
                yield from prior(other, seen | {other})

    observations = [
        StoredObservation(
            scope=tuple(r["scope"]),
            text=r["text"],
            sources=tuple(
                sorted(
                    (key_of.get(i, str(i)) for i in r["sources"]),
                    key=lambda k: order.get(k, len(order)),
                )
            ),
            prior_texts=tuple(dict.fromkeys(prior(r["id"], frozenset({r["id"]})))),
        )
        for r in rows
    ]
    observations.sort(
        key=lambda o: (o.scope, min((order.get(k, len(order)) for k in o.sources), default=0))
    )
    actions: dict[uuid.UUID, list[dict[str, Any]]] = {}
    for o in outcomes:
        row = o["row"] if isinstance(o["row"], dict) else {}
        actions.setdefault(o["memory_id"], []).append(row)
    fates = [
        MemoryFate(
            key=key_of.get(m["id"], str(m["id"])),
            actions=tuple(str(a.get("action")) for a in actions.get(m["id"], [])),
            failed_reason=(m["consolidation_failed_reason"] or "no reason recorded")
            if m["failed"]
            else None,
            consolidated=bool(m["consolidated"]),
            skip_reason=next(
                (str(a["reason"]) for a in actions.get(m["id"], []) if a.get("reason")), None
            ),
        )
        for m in markers
    ]
    return observations, fates


def _transcript(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + "-oracle.jsonl")


def _calls(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + "-calls.jsonl")


def _add_token_split(banks: dict[str, dict[str, Any]], transcript: Path) -> None:
    """Each bank's prompt split into its parts and its shared prefixes
    (:mod:`bench.perf.tokens`), from the requests the oracle or the recorder in front of a real
    server wrote down, the run's usage (the oracle's estimate, the server's count) shared out by
    characters."""
    if not transcript.exists():
        return
    requests: dict[str, list[list[tokens.Message]]] = {}
    for line in transcript.read_bytes().splitlines():
        call = orjson.loads(line)
        bank = call["request"].get("bank")
        messages = [(str(role), str(content)) for role, content in call.get("messages", [])]
        if isinstance(bank, str) and messages:
            requests.setdefault(bank, []).append(messages)
    for name, result in banks.items():
        if requests.get(name):
            figures = result.get("figures") or {}
            report = tokens.token_report(
                requests[name],
                result["memories"],
                prompt_tokens=figures.get("prompt_tokens"),
                completion_tokens=figures.get("completion_tokens", 0),
            )
            result["tokens"] = report.to_json()


@contextlib.contextmanager
def _server_process(command: list[str], err_path: Path, what: str) -> Iterator[str]:
    """A bench server in a process of its own that prints its base URL on its first line (once
    it listens); yields the URL and stops the process on exit."""
    with err_path.open("wb") as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL
        )
        try:
            assert process.stdout is not None
            url = process.stdout.readline().decode().strip()
            if not url.startswith("http"):
                raise RuntimeError(
                    f"the {what} did not start (exit {process.poll()}); see {err.name}"
                )
            yield url
        finally:
            stop_process(process, 5.0)


@contextlib.contextmanager
def recorder_server(upstream: str, prefix: Path) -> Iterator[str]:
    """:mod:`bench.quality.recorder` in front of ``upstream``; yields its base URL."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [
        *(sys.executable, "-m", "bench.quality.recorder"),
        *("--upstream", upstream, "--transcript", str(_calls(prefix))),
    ]
    with _server_process(
        command, prefix.with_name(prefix.name + "-recorder.log"), "recorder"
    ) as url:
        yield url


@contextlib.contextmanager
def oracle_server(banks: tuple[QualityBank, ...], prefix: Path) -> Iterator[str]:
    """The oracle in a process of its own, serving ``banks``; yields its base URL."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "bench.quality.oracle",
        "--transcript",
        str(_transcript(prefix)),
    ]
    for qbank in banks:
        command += ["--bank-file", str(qbank.path)]
    with _server_process(command, prefix.with_name(prefix.name + "-oracle.log"), "oracle") as url:
        yield url
