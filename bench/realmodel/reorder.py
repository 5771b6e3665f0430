"""``python -m bench.realmodel.reorder RESULTS_DIR --fact WORDS``: decide requests a quality run
logged, asked again of the lane's model as logged and with the candidates in reverse order, to
see whether a pick holds whatever the order (docs/quality.md, "What a change is shown").

A quality run at ``CONSOLIDATION_LOG_LEVEL=DEBUG`` logs each fact's candidates in its
``v2_decisions`` entries (``RESULTS_DIR/logs/*-replay.log``) and the bank it ingested
(``*-bank.jsonl``, the facts' tags). Each ``--fact`` picks the first logged fact that contains
its words; each request holds that fact alone, its candidates without the dates a run shows. Against the lane's model (``--model``; ``python
-m bench realmodel`` installs it) or any OpenAI-compatible endpoint (``--base-url``,
``--llm-model``). The server reuses the previous prompt's evaluation, so an answer on the edge
may differ from the quality run's (:mod:`bench.realmodel.probe`).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.realmodel.server import add_endpoint_arguments, on_endpoint_or_lane
from consolidation.errors import InvalidLLMOutput
from consolidation.llm.client import HTTPConsolidator
from consolidation.llm.prompts_v2 import Decision, Question, Shown, decide_chat, parse_decisions


@dataclass(frozen=True)
class Logged:
    """One fact of a logged pass: its bank, its tags and the candidates it was shown, in order."""

    bank: str
    scope: tuple[str, ...]
    fact: str
    candidates: tuple[str, ...]


def _bank_of(log: Path) -> str:
    # quality-<stamp>-<bank>-replay.log
    return log.name.split("-", 2)[2].removesuffix("-replay.log")


def logged(results: Path) -> Iterator[Logged]:
    """Every ``v2_decisions`` entry of the run in ``results``, in the order it was logged."""
    for log in sorted((results / "logs").glob("*-replay.log")):
        bank = _bank_of(log)
        tags: dict[str, tuple[str, ...]] = {}
        for path in (results / "logs").glob(f"*-{bank}-bank.jsonl"):
            for line in path.read_bytes().splitlines():
                row = orjson.loads(line)
                tags[row["text"]] = tuple(row["tags"])
        for line in log.read_bytes().splitlines():
            if b"v2_decisions" not in line:
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            for entry in record.get("decisions", ()):
                yield Logged(
                    bank, tags.get(entry["fact"], ()), entry["fact"], tuple(entry["candidates"])
                )


def find(results: Path, words: Sequence[str]) -> list[Logged]:
    """The first logged fact containing each of ``words`` (case-insensitive); ValueError names
    the words no logged fact contains."""
    entries = list(logged(results))
    found, missing = [], []
    for word in words:
        match = next((e for e in entries if word.lower() in e.fact.lower()), None)
        if match is None:
            missing.append(word)
        else:
            found.append(match)
    if missing:
        raise ValueError(f"no logged fact of {results} contains {missing}")
    return found


def questions(entry: Logged) -> tuple[Question, Question]:
    """The fact's question as logged and with its candidates reversed; a candidate keeps its
    ref, so a pick names the same text in both."""
    shown = tuple(Shown(f"o{i}", text) for i, text in enumerate(entry.candidates, 1))
    fact = Shown("f1", entry.fact)
    return Question(fact, shown), Question(fact, shown[::-1])


def picked(question: Question, decision: Decision) -> str:
    """``decision`` told by the candidate's text: ``update <text>``, ``same <text>`` or ``new``."""
    text = next((c.text for c in question.candidates if c.ref == decision.target), "")
    return f"{decision.kind} {text}".strip()


async def ask(llm: HTTPConsolidator, entries: Sequence[Logged]) -> list[tuple[str, str]]:
    """Each entry's pick as logged and reversed ("unusable" when the answer is not)."""
    answers = []
    for entry in entries:
        pair = []
        for question in questions(entry):
            chat = decide_chat(entry.bank, entry.scope, None, [question])
            try:
                decision = parse_decisions((await llm.complete(chat)).content, [question])["f1"]
            except InvalidLLMOutput:
                pair.append("unusable")
            else:
                pair.append(picked(question, decision))
        answers.append((pair[0], pair[1]))
    return answers


def render(entries: Sequence[Logged], answers: Sequence[tuple[str, str]]) -> str:
    lines = []
    for entry, (forward, backward) in zip(entries, answers, strict=True):
        held = "held" if forward == backward else "moved"
        lines += [
            f"[{entry.bank}] {entry.fact} ({len(entry.candidates)} candidates): {held}",
            f"  as logged: {forward}",
            f"  reversed:  {backward}",
        ]
    return "\n".join(lines)


async def _run(url: str, model: str, entries: Sequence[Logged]) -> list[tuple[str, str]]:
    llm = HTTPConsolidator(base_url=url, model=model, timeout_s=900)
    try:
        return await ask(llm, entries)
    finally:
        await llm.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.realmodel.reorder", description=__doc__)
    parser.add_argument("results", type=Path, help="a quality run's --results-dir")
    parser.add_argument("--fact", action="append", required=True, help="words of a logged fact")
    add_endpoint_arguments(parser)
    args = parser.parse_args(argv)
    try:
        entries = find(args.results, args.fact)
    except ValueError as exc:
        parser.error(str(exc))
    answers = on_endpoint_or_lane(
        parser,
        args,
        "reorder-server.log",
        lambda url, model: asyncio.run(_run(url, model, entries)),
    )
    print(render(entries, answers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
