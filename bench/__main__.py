"""``python -m bench``: run the benchmark scenarios, print a table, write JSON (and the docs).

python -m bench all            # every target (about 15 minutes on 2 cores); updates docs
python -m bench all --quick    # smaller banks, fewer repeats (a few minutes)
python -m bench efficiency|lag|throughput|rss|profile|realistic [--quick]
python -m bench tokens [--setting NAME=VALUE]   # tokens per memory, split by part
python -m bench plan           # ideal times of several bank shapes, no database
python -m bench fairness       # small banks' wait behind a 10,000-memory bank (one serve)
python -m bench fleet [--quick]   # 1, 2 and 4 serve replicas on one Postgres, 200 banks via the API
python -m bench generate N > bank.jsonl   # a bank for `consolidation ingest`
python -m bench recall         # recall quality: full text vs hybrid, all-MiniLM-L6-v2 on CPU
python -m bench minilm [--check | --port N]   # that model behind /v1/embeddings
python -m bench realmodel      # against llama-cpp-python and a real GGUF (docs/real-models.md)
python -m bench quality --oracle|--offline|--model M|--base-url U   # observation quality
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench.infra import pgvector_server
from bench.perf import fairness, fleet, report, scenarios
from bench.perf.workload import BankShape, generate
from bench.quality import judge as quality_judge
from bench.quality import render as quality_render
from bench.quality import run as quality_run
from bench.realmodel import run as realmodel

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
RESULTS = Path(__file__).resolve().parent / "results"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = scenarios.QUICK if args.quick else scenarios.FULL
    url = args.database_url
    results: dict[str, Any] = {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "mode": sizes.name,
        "sizes": sizes.__dict__,
        "machine": await report.machine(url),
    }
    bank = scenarios.BankOptions(args.groups, args.zipf, args.combined_only, args.wave_size)
    results["bank"] = bank.__dict__
    bench = scenarios.Bench(url, args.results_dir, _log)
    started = time.perf_counter()
    what = args.command
    try:
        if what in ("all", "efficiency"):
            results["efficiency"] = await scenarios.efficiency(bench, sizes, args.loop, bank)
        if what in ("all", "lag"):
            results["lag"] = await scenarios.lag(bench, sizes, args.loop, bank)
        if what in ("all", "throughput", "rss"):
            results["throughput"] = await scenarios.throughput(bench, sizes, args.loop, bank)
        if what in ("all", "rss"):
            results["rss"] = await scenarios.rss(
                bench, sizes, results["throughput"], args.loop, bank
            )
        if what == "tokens":
            settings = dict(item.split("=", 1) for item in args.setting)
            if args.memories:
                sizes = dataclasses.replace(sizes, efficiency_memories=args.memories)
            results["tokens"] = await scenarios.tokens(bench, sizes, args.loop, bank, settings)
        if what == "realistic":
            from bench.perf import realistic

            results["realistic"] = await realistic.realistic(
                bench, sizes, args.loop, bank, args.median_ms, args.p99_ms, args.hedge_quantile
            )
        if what == "embeddings":
            async with pgvector_server(url, _log) as vector_url:
                vector_bench = scenarios.Bench(vector_url, args.results_dir, _log)
                try:
                    results["embeddings"] = await scenarios.embeddings_cost(
                        vector_bench, sizes, args.loop, bank, args.latency_ms
                    )
                finally:
                    await vector_bench.close()
        if what == "profile" or (what == "all" and args.profile):
            results["profile"] = await scenarios.profile(bench, sizes, args.loop, bank)
        if what == "all":
            results["plan_study"] = report.plan_study()
            results["schedule_study"] = report.schedule_study()
    finally:
        await bench.close()
    results["duration_s"] = time.perf_counter() - started
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def _save(results: dict[str, Any], results_dir: Path, command: str) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"{command}-{stamp}.json"
    data = orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    path.write_bytes(data)
    (results_dir / f"latest-{command}.json").write_bytes(data)
    return path


def cmd_run(args: argparse.Namespace) -> int:
    results = asyncio.run(_run(args))
    path = _save(results, args.results_dir, args.command)
    print(report.render_table(results))
    if "embeddings" in results:
        print(report.render_embeddings(results["embeddings"]))
    if "tokens" in results:
        from bench.perf import tokens

        print(tokens.render("tokens", results["tokens"]))
    if "realistic" in results:
        from bench.perf import realistic

        print(realistic.render(results["realistic"]))
    print(f"\nJSON: {path}")
    write = args.docs if args.docs is not None else (args.command == "all" and not args.quick)
    if write:
        report.write_docs(report.render_markdown(results))
        print(f"docs: {report.DOCS}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Render a saved result again (table, and the docs block with --docs)."""
    results = orjson.loads(args.json.read_bytes())
    if results.get("mode") == "full" or args.force:
        # The shape and schedule studies are pure functions of the code, not of the run.
        results.setdefault("plan_study", report.plan_study())
        results.setdefault("schedule_study", report.schedule_study())
    print(report.render_table(results))
    if args.docs:
        report.write_docs(report.render_markdown(results))
        print(f"docs: {report.DOCS}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    print(report.render_plan_study(report.plan_study(args.memories)))
    print()
    print(report.render_schedule_study(report.schedule_study(args.memories)))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    shape = BankShape(memories=args.memories, groups=args.groups, zipf_s=args.zipf, seed=args.seed)
    out = sys.stdout.buffer
    for memory in generate(shape):
        out.write(orjson.dumps(memory) + b"\n")
    return 0


def cmd_recall(args: argparse.Namespace) -> int:
    from bench.recall import data as recall_data
    from bench.recall import run as recall

    if args.regenerate:
        print(f"wrote {recall_data.write()}")
    results = asyncio.run(recall.run(args.database_url, _log))
    results["command"] = "python -m bench " + shlex.join(sys.argv[1:])
    results["machine"] = {"loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    path = _save(results, args.results_dir, "recall")
    print(recall.render(results))
    print(f"\ntargets met: {results['targets_met']} {results['targets']}")
    print(f"JSON: {path}")
    return 0


def cmd_minilm(args: argparse.Namespace) -> int:
    from bench.recall import minilm

    if args.check:
        result = minilm.check()
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return 0 if result["ok"] else 1
    minilm.serve(args.host, args.port)
    return 0


def cmd_realmodel(args: argparse.Namespace) -> int:
    if args.report:
        print(
            realmodel.render_table(
                realmodel.rejudge(orjson.loads(args.report.read_bytes()), args.bank_file)
            )
        )
        return 0
    results = asyncio.run(realmodel.run(args, _log))
    path = _save(results, args.results_dir, "realmodel")
    print(realmodel.render_table(results))
    print(f"\nJSON: {path}")
    return 0 if results["operation"].get("status") == "completed" else 1


def cmd_quality(args: argparse.Namespace) -> int:
    if args.report:
        saved = quality_run.rejudge(orjson.loads(args.report.read_bytes()), args.bank_file)
        if args.markdown:
            print(quality_render.render_markdown(saved))
            print()
            print(quality_render.render_baselines_markdown(saved))
        else:
            print(quality_render.render(saved))
        return 0
    results = asyncio.run(quality_run.run(args, _log))
    path = _save(results, args.results_dir, f"quality-{results['mode']}")
    print(quality_render.render(results))
    print(f"\nJSON: {path}")
    banks = results["banks"].values()
    if not all((b.get("operation") or {}).get("status") == "completed" for b in banks):
        return 1
    # The oracle's shortfalls are the pipeline's own: a gate, not a figure.
    if results["mode"] == "oracle" and any(quality_judge.shortfalls(b["judgement"]) for b in banks):
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("all", "every scenario; writes docs/benchmarks.md (full mode)"),
        ("efficiency", "P8 vs the plan's ideal time, and P1 on the same bank (speedup)"),
        ("lag", "event-loop lag with 16 concurrent calls and 200 KB answers"),
        ("throughput", "memories/s with a zero-latency LLM"),
        ("rss", "peak RSS on the throughput bank and on a bank 10x larger"),
        ("profile", "the zero-latency run under py-spy and pyinstrument"),
        ("embeddings", "zero-latency memories/s and recall cost, embeddings off vs on"),
        ("realistic", "efficiency at a real server's heavy-tailed latency (median 1 s, p99 8 s)"),
        ("tokens", "tokens per memory on the efficiency bank, split by part; prefix reuse"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--quick", action="store_true", help="smaller banks, fewer repeats")
        p.add_argument(
            "--database-url",
            default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL),
            help="a Postgres server where bench_* databases may be created "
            "(env BENCH_DATABASE_URL)",
        )
        p.add_argument("--results-dir", type=Path, default=RESULTS)
        p.add_argument(
            "--loop",
            choices=("auto", "asyncio", "uvloop"),
            default="auto",
            help="event loop of the engine process, as CONSOLIDATION_EVENT_LOOP (auto: uvloop "
            "when installed, as the service)",
        )
        p.add_argument(
            "--docs",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="write docs/benchmarks.md (default: only for a full `all`)",
        )
        default = scenarios.DEFAULT_BANK
        p.add_argument("--groups", type=int, default=default.groups, help="tag groups")
        p.add_argument("--zipf", type=float, default=default.zipf_s, help="Zipf exponent")
        p.add_argument(
            "--combined-only",
            action="store_true",
            help="every memory in one combined scope (no per_tag, shared, … modes)",
        )
        p.add_argument("--wave-size", type=int, default=default.wave_size)
        if name == "all":
            p.add_argument("--profile", action="store_true", help="also run the profiles")
        if name == "embeddings":
            p.add_argument(
                "--latency-ms", type=float, default=0.0, help="the fake LLM's latency (0)"
            )
        if name == "tokens":
            p.add_argument(
                "--setting",
                action="append",
                default=[],
                metavar="NAME=VALUE",
                help="a setting of the engine (CONSOLIDATION_NAME without the prefix, lower "
                "case), e.g. llm_batch_size=16; repeatable",
            )
            p.add_argument(
                "--memories", type=int, help="bank size (default: the efficiency bank's)"
            )
        if name == "realistic":
            p.add_argument("--median-ms", type=float, default=1000.0, help="latency median")
            p.add_argument("--p99-ms", type=float, default=8000.0, help="latency p99")
            p.add_argument(
                "--hedge-quantile",
                type=float,
                default=0.9,
                help="LLM_HEDGE_QUANTILE of the hedged configurations (0.9)",
            )
        p.set_defaults(handler=cmd_run)
    p = sub.add_parser("report", help="render a saved result again (and the docs block)")
    p.add_argument("json", type=Path, nargs="?", default=RESULTS / "latest-all.json")
    p.add_argument("--docs", action="store_true", help="rewrite the block of docs/benchmarks.md")
    p.add_argument("--force", action="store_true", help="add the studies to a quick result too")
    p.set_defaults(handler=cmd_report)
    p = sub.add_parser("plan", help="ideal times of several bank shapes (no database)")
    p.add_argument("--memories", type=int, default=1600)
    p.set_defaults(handler=cmd_plan)
    fairness.add_parser(sub)
    fleet.add_parser(sub)
    p = sub.add_parser("generate", help="write a bank as JSONL (for `consolidation ingest`)")
    p.add_argument("memories", type=int)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--zipf", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=BankShape(memories=0).seed)
    p.set_defaults(handler=cmd_generate)
    p = sub.add_parser("recall", help="recall quality: full text vs hybrid (real model on CPU)")
    p.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL),
        help="a Postgres server (with pgvector, else the embedded one is used)",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument(
        "--regenerate", action="store_true", help="first rewrite bench/data/recall_cases.json"
    )
    p.set_defaults(handler=cmd_recall)
    p = sub.add_parser("minilm", help="all-MiniLM-L6-v2 (numpy) behind /v1/embeddings")
    p.add_argument("--check", action="store_true", help="compare with the reference similarities")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8088)
    p.set_defaults(handler=cmd_minilm)
    realmodel.add_parser(sub, os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL), RESULTS)
    sub.choices["realmodel"].set_defaults(handler=cmd_realmodel)
    quality_run.add_parser(sub, os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL), RESULTS)
    sub.choices["quality"].set_defaults(handler=cmd_quality)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    handler = args.handler
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
