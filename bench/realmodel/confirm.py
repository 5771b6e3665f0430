"""``python -m bench.realmodel.confirm``: contract v2's yes/no question asked of a model on the
labelled pairs of the quality banks, each pair on its own, and how often the answer is right.

A quality run asks the question only where the engine doubts a pick, a few times a bank, so it
says little about the question itself. Here every pair the banks' labels make is asked:

- ``same label``: a later fact of a duplicate or state-change label and its label's first
  fact, standing for the observation it joins (the answer should be yes);
- ``hard negative``: facts of two labels a bank keeps apart (``distinct_from``; no);
- ``shares a word``: facts of two other labels of one scope that share a telling word (no);
- with ``--set changes``, every fact that announces a change against the first fact of each
  label of its scope told before it: ``change of it`` (yes) and ``change of another`` (no);
- with ``--set ends``, every fact that says which value it replaces against each earlier fact
  of its label that states that value (``states its old value``, yes: the question the engine
  asks before a change ends an observation beside the one it updates) and against the first
  fact of each other label of its scope told before it (``change of another``, no).

Each pair is asked as the engine asks it (of the ``ends`` set, with the instructions of a change,
``prompts_v2.CHANGE_CONFIRM_PROMPT``); with ``--change-instructions`` any other fact that announces
a change is asked with those too, a variant docs/quality.md measured and the engine did not adopt
there; with ``--instructions FILE`` every pair is asked with that file's instructions (the variants
docs/quality.md measured are in ``bench/realmodel/variants/``); with ``--name-subjects`` the answer
names what the observation and the fact are each about before its yes or no (:data:`NAMED`,
asked with ``variants/confirm-name-subjects.txt`` unless ``--instructions`` says otherwise), a
variant docs/quality.md measured and the engine did not adopt; with ``--subjects-alone`` no pair is
asked: each text is asked on its own what kind of thing it tells of, in one to three words
(``variants/subject-alone.txt``), and a pair's answer is yes when the two kinds share a word
stem (:func:`narrow.overlap`), a question the engine does not ask. ``--fresh-context`` serves the
lane's model as ``bench quality --fresh-context`` does. Against the lane's model (``--model``; its
venv and model must be installed: ``python -m bench realmodel`` once) or any OpenAI-compatible
endpoint (``--base-url``, ``--llm-model``). A few minutes a bank on the lane; the server reuses the
previous prompt's evaluation, so an answer on the edge may differ from a quality run's
(:mod:`bench.realmodel.probe`) unless both run with ``--fresh-context``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.quality.banks import DEFAULT_BANK_FILES, QualityBank, load_banks
from bench.realmodel.report import LabelledMemory
from bench.realmodel.server import add_endpoint_arguments, on_endpoint_or_lane
from consolidation.errors import InvalidLLMOutput
from consolidation.llm import narrow
from consolidation.llm.client import HTTPConsolidator
from consolidation.llm.prompts import Chat
from consolidation.llm.prompts_v2 import (
    NO,
    YES,
    Shown,
    confirm_chat,
    object_schema,
    parse_confirm,
)

SAME_LABEL = "same label"
HARD_NEGATIVE = "hard negative"
SHARES_A_WORD = "shares a word"
CHANGE_OF_IT = "change of it"
CHANGE_OF_ANOTHER = "change of another"
STATES_OLD_VALUE = "states its old value"
KINDS = (
    SAME_LABEL,
    HARD_NEGATIVE,
    SHARES_A_WORD,
    CHANGE_OF_IT,
    CHANGE_OF_ANOTHER,
    STATES_OLD_VALUE,
)
YES_KINDS = frozenset({SAME_LABEL, CHANGE_OF_IT, STATES_OLD_VALUE})
SETS = ("pairs", "changes", "ends")
VARIANTS = Path(__file__).with_name("variants")
# ``--name-subjects``: the answer's fields, in the order the model writes them, and room for them.
NAMED = object_schema(
    {
        "observation_is_about": {"type": "string", "maxLength": 60},
        "fact_is_about": {"type": "string", "maxLength": 60},
        "same_subject": {"type": "string", "enum": [YES, NO]},
    }
)
NAMED_MAX_TOKENS = 80
# ``--subjects-alone``: one text's kind of thing, asked on its own.
ALONE = object_schema({"about": {"type": "string", "maxLength": 40}})
ALONE_MAX_TOKENS = 24


@dataclass(frozen=True)
class Pair:
    """One question: is ``fact`` about what ``observation`` states."""

    bank: str
    scope: tuple[str, ...]
    observation: str
    fact: str
    kind: str

    @property
    def want(self) -> bool:
        return self.kind in YES_KINDS


def _scopes(qbank: QualityBank) -> dict[tuple[str, ...], list[LabelledMemory]]:
    by_scope: dict[tuple[str, ...], list[LabelledMemory]] = {}
    for memory in sorted(qbank.bank.memories, key=lambda m: m.occurred_at or ""):
        by_scope.setdefault(tuple(memory.tags), []).append(memory)
    return by_scope


def pairs(qbank: QualityBank) -> list[Pair]:
    """The ``same label``, ``hard negative`` and ``shares a word`` pairs of a bank."""
    hard = {frozenset(p) for p in qbank.hard_negatives}
    found: list[Pair] = []
    for scope, memories in _scopes(qbank).items():
        common = narrow.common_stems(m.text for m in memories) | narrow.scope_stems(scope)
        first: dict[str, LabelledMemory] = {}
        for memory in memories:
            head = first.setdefault(memory.label, memory)
            kind = qbank.bank.labels[memory.label].kind
            if head is not memory and kind != "fact":
                found.append(Pair(qbank.name, scope, head.text, memory.text, SAME_LABEL))
        for a, b in itertools.combinations(memories, 2):
            if a.label == b.label:
                continue
            if frozenset((a.label, b.label)) in hard:
                found.append(Pair(qbank.name, scope, a.text, b.text, HARD_NEGATIVE))
            elif narrow.telling_words(a.text, b.text, common):
                found.append(Pair(qbank.name, scope, a.text, b.text, SHARES_A_WORD))
    return found


def change_pairs(qbank: QualityBank) -> list[Pair]:
    """Every fact that announces a change against the first fact of each label of its scope
    told before it."""
    found: list[Pair] = []
    for scope, memories in _scopes(qbank).items():
        first: dict[str, LabelledMemory] = {}
        for memory in memories:
            if narrow.announces_change(memory.text):
                found += [
                    Pair(
                        qbank.name,
                        scope,
                        head.text,
                        memory.text,
                        CHANGE_OF_IT if label == memory.label else CHANGE_OF_ANOTHER,
                    )
                    for label, head in first.items()
                ]
            first.setdefault(memory.label, memory)
    return found


def ends_pairs(qbank: QualityBank) -> list[Pair]:
    """Every fact that says which value it replaces (:func:`narrow.changes`, as
    :func:`narrow.made_stale` reads it) against each fact of its label told before it that
    states that value and none of the new one (``states its old value``: what the engine asks
    before it ends an observation beside the one the change updates), and against the first
    fact of each other label of its scope told before it (``change of another``)."""
    found: list[Pair] = []
    for scope, memories in _scopes(qbank).items():
        first: dict[str, LabelledMemory] = {}
        for at, memory in enumerate(memories):
            if narrow.changes(memory.text):
                found += [
                    Pair(qbank.name, scope, earlier.text, memory.text, STATES_OLD_VALUE)
                    for earlier in memories[:at]
                    if earlier.label == memory.label
                    and narrow.ended_values(memory.text, earlier.text)
                ]
                found += [
                    Pair(qbank.name, scope, head.text, memory.text, CHANGE_OF_ANOTHER)
                    for label, head in first.items()
                    if label != memory.label
                ]
            first.setdefault(memory.label, memory)
    return found


async def ask(
    llm: HTTPConsolidator,
    asked: Sequence[Pair],
    *,
    change_instructions: bool,
    instructions: str | None = None,
    of_change: bool = False,
    name_subjects: bool = False,
    said: list[str] | None = None,
) -> list[bool | None]:
    """The model's answer to each pair, one request at a time; None for an unusable answer.
    ``of_change``: asked as the engine asks what a change ends; ``instructions`` replace the
    question's for every pair; ``name_subjects``: the answer names both subjects first
    (:data:`NAMED`). Each answer's text is appended to ``said`` when given."""
    answers: list[bool | None] = []
    for pair in asked:
        chat = confirm_chat(
            pair.bank,
            pair.scope,
            None,
            Shown("f1", pair.fact),
            Shown("o1", pair.observation),
            of_change=of_change or (change_instructions and narrow.announces_change(pair.fact)),
        )
        if name_subjects:
            chat = dataclasses.replace(chat, schema=NAMED, max_tokens=NAMED_MAX_TOKENS)
        if instructions is not None:
            chat = dataclasses.replace(chat, system=instructions)
        content = (await llm.complete(chat)).content
        if said is not None:
            said.append(content)
        try:
            answers.append(parse_confirm(content))
        except InvalidLLMOutput:
            answers.append(None)
    return answers


async def ask_alone(
    llm: HTTPConsolidator, asked: Sequence[Pair], instructions: str, said: list[str]
) -> list[bool | None]:
    """Each distinct text of ``asked`` asked on its own what kind of thing it tells of
    (:data:`ALONE`); a pair's answer is whether its two kinds share a word stem, None when
    either answer is unusable. Each answer's text is appended to ``said`` per pair, as
    ``fact kind | observation kind``."""
    kinds: dict[str, str | None] = {}
    for pair in asked:
        for text in (pair.fact, pair.observation):
            if text in kinds:
                continue
            user = {"contract": "v2", "task": "about", "text": text}
            chat = Chat(instructions, orjson.dumps(user).decode(), ALONE, ALONE_MAX_TOKENS)
            try:
                answer = orjson.loads((await llm.complete(chat)).content)
            except orjson.JSONDecodeError:
                answer = None
            about = answer.get("about") if isinstance(answer, dict) else None
            kinds[text] = about if isinstance(about, str) and about.strip() else None
    answers: list[bool | None] = []
    for pair in asked:
        fact, observation = kinds[pair.fact], kinds[pair.observation]
        said.append(f"{fact} | {observation}")
        if fact is None or observation is None:
            answers.append(None)
        else:
            answers.append(narrow.overlap(fact, observation) > 0)
    return answers


def render(asked: Sequence[Pair], answers: Sequence[bool | None]) -> str:
    """A line per bank and kind: how many pairs got the answer their labels want, then the
    pairs that did not."""
    right: Counter[tuple[str, str]] = Counter()
    total: Counter[tuple[str, str]] = Counter()
    misses = []
    for pair, answer in zip(asked, answers, strict=True):
        total[pair.bank, pair.kind] += 1
        if answer == pair.want:
            right[pair.bank, pair.kind] += 1
        else:
            said = "unusable" if answer is None else ("yes" if answer else "no")
            misses.append(f"  {said:8} {pair.kind:17} {pair.observation} | {pair.fact}")
    lines = ["bank                 kind               right  (wanted)"]
    for bank, kind in sorted(total, key=lambda k: (k[0], KINDS.index(k[1]))):
        want = "yes" if kind in YES_KINDS else "no"
        lines.append(f"{bank:20} {kind:17} {right[bank, kind]:3}/{total[bank, kind]:<3} ({want})")
    return "\n".join([*lines, "answered otherwise:", *misses])


async def _run(
    url: str,
    model: str,
    asked: Sequence[Pair],
    *,
    change_instructions: bool,
    instructions: str | None,
    of_change: bool,
    name_subjects: bool,
    subjects_alone: bool,
    said: list[str],
) -> list[bool | None]:
    llm = HTTPConsolidator(base_url=url, model=model, timeout_s=600)
    try:
        if subjects_alone:
            assert instructions is not None
            return await ask_alone(llm, asked, instructions, said)
        return await ask(
            llm,
            asked,
            change_instructions=change_instructions,
            instructions=instructions,
            of_change=of_change,
            name_subjects=name_subjects,
            said=said,
        )
    finally:
        await llm.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.realmodel.confirm", description=__doc__)
    add_endpoint_arguments(parser)
    parser.add_argument("--bank", action="append", help="a bank id (repeatable; default all)")
    parser.add_argument("--set", choices=SETS, default="pairs", dest="which")
    parser.add_argument(
        "--change-instructions",
        action="store_true",
        help="ask a fact that announces a change with CHANGE_CONFIRM_PROMPT",
    )
    parser.add_argument(
        "--instructions",
        type=Path,
        help="ask every pair with the instructions in this file instead (a variant to measure)",
    )
    parser.add_argument(
        "--name-subjects",
        action="store_true",
        help="the answer names what each text is about before its yes or no",
    )
    parser.add_argument(
        "--subjects-alone",
        action="store_true",
        help="ask each text alone what kind of thing it tells of; yes when two kinds share a word",
    )
    parser.add_argument("--json", type=Path, help="write every pair and its answer here")
    args = parser.parse_args(argv)
    if args.name_subjects and args.subjects_alone:
        parser.error("--name-subjects and --subjects-alone are two variants: give one")
    if args.name_subjects and not args.instructions:
        args.instructions = VARIANTS / "confirm-name-subjects.txt"
    if args.subjects_alone and not args.instructions:
        args.instructions = VARIANTS / "subject-alone.txt"
    try:
        instructions = args.instructions.read_text() if args.instructions else None
    except OSError as exc:
        parser.error(f"cannot read --instructions: {exc}")
    banks = load_banks(DEFAULT_BANK_FILES)
    unknown = sorted(set(args.bank or ()) - {b.name for b in banks})
    if unknown:
        parser.error(f"unknown bank(s) {unknown}; known: {sorted(b.name for b in banks)}")
    chosen = [b for b in banks if not args.bank or b.name in args.bank]
    make = {"pairs": pairs, "changes": change_pairs, "ends": ends_pairs}[args.which]
    asked = [pair for qbank in chosen for pair in make(qbank)]
    said: list[str] = []
    answers = on_endpoint_or_lane(
        parser,
        args,
        "confirm-server.log",
        lambda url, model: asyncio.run(
            _run(
                url,
                model,
                asked,
                change_instructions=args.change_instructions,
                instructions=instructions,
                of_change=args.which == "ends",
                name_subjects=args.name_subjects,
                subjects_alone=args.subjects_alone,
                said=said,
            )
        ),
    )
    if args.json:
        rows = [
            {**vars(p), "want": p.want, "answer": a, "said": text}
            for p, a, text in zip(asked, answers, said, strict=True)
        ]
        args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    print(render(asked, answers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
