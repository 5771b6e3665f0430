"""``python -m bench.realmodel.probe``: one confirm question asked of the lane's model after
different requests, to show whether an answer depends on what the server was asked before.

llama-cpp-python's server keeps the previous prompt's evaluation and reuses its longest common
prefix, so the same request is computed in other pieces after another request; at temperature
0 a borderline answer can turn. A quality run in which a change moves one such question (say,
to the first call of a bank) can then differ from main without the change deciding anything
differently (docs/quality.md); with ``--fresh-context`` every answer is its request's alone.
Needs the lane's server venv and model (``python -m bench realmodel`` installs both).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from bench.realmodel.server import DEFAULT_HOME, MODELS, installed_server
from consolidation.llm.client import HTTPConsolidator
from consolidation.llm.prompts import Chat
from consolidation.llm.prompts_v2 import Question, Shown, confirm_chat, decide_chat

BANK, SCOPE = "realmodel", ("user",)
# The lane bank's borderline pair: the flat is a detail of the residence.
CONFIRM = confirm_chat(
    BANK,
    SCOPE,
    None,
    Shown("f4", "My flat in Paris is close to the Canal Saint-Martin."),
    Shown("o1", "I live in Paris, in the 11th arrondissement."),
)


def _decide(fact: str, candidate: str) -> Chat:
    return decide_chat(BANK, SCOPE, None, [Question(Shown("f1", fact), (Shown("o1", candidate),))])


BEFORE: tuple[tuple[str, Chat | None], ...] = (
    ("first request after the warm-up", None),
    ("after the same request", None),
    (
        "after a decide call",
        _decide(
            "Because of my peanut allergy I always carry an EpiPen.", "I'm allergic to peanuts."
        ),
    ),
    ("after the same request", None),
    ("after another decide call", _decide("I drink my coffee black.", "Coffee is always black.")),
)


def pair_question(fact: str, observation: str, *, of_change: bool = False) -> Chat:
    """The yes/no question of ``fact`` and ``observation`` (scope 'user'), as the engine asks
    it of a pick, or with ``of_change`` as it asks what a change ends."""
    return confirm_chat(
        BANK, SCOPE, None, Shown("f1", fact), Shown("o1", observation), of_change=of_change
    )


async def probe(url: str, alias: str, question: Chat = CONFIRM) -> list[tuple[str, str]]:
    """Each situation of :data:`BEFORE` and the model's answer to ``question`` in it."""
    llm = HTTPConsolidator(base_url=url, model=alias, timeout_s=600)
    answers: list[tuple[str, str]] = []
    try:
        for situation, before in BEFORE:
            if before is not None:
                await llm.complete(before)
            answers.append((situation, (await llm.complete(question)).content))
    finally:
        await llm.aclose()
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.realmodel.probe", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(MODELS))
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_HOME)
    parser.add_argument(
        "--fresh-context",
        action="store_true",
        help="serve with every prompt evaluated from an empty context (the lane's option)",
    )
    parser.add_argument(
        "--pair",
        nargs=2,
        metavar=("FACT", "OBSERVATION"),
        help="ask the yes/no question of this fact and observation instead (scope 'user')",
    )
    parser.add_argument(
        "--of-change",
        action="store_true",
        help="with --pair: ask it as the engine asks what a change ends",
    )
    args = parser.parse_args(argv)
    question = CONFIRM
    if args.of_change and not args.pair:
        parser.error("--of-change asks a --pair")
    if args.pair:
        fact, observation = args.pair
        question = pair_question(fact, observation, of_change=args.of_change)
    try:
        server = installed_server(
            args.cache_dir, args.model, "probe-server.log", fresh_context=args.fresh_context
        )
    except FileNotFoundError as exc:
        parser.error(str(exc))
    with server:
        for situation, answer in asyncio.run(probe(server.url, args.model, question)):
            print(f"{situation:35} {answer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
