"""The v2 LLM wire contract (``CONSOLIDATION_LLM_CONTRACT=v2``): two small questions. Pure.

A ``decide`` request asks, per fact, only ``new`` / ``same:X`` / ``update:X`` among that fact's
own candidates (the schema pins each fact's answer to that enum); a ``rewrite`` request asks for
the new text of one observation given the facts that update it. The engine, not the model,
turns the answers into a :class:`consolidation.llm.prompts.PassPlan` (:mod:`consolidation.llm.narrow`).
Both user objects carry ``"contract": "v2"`` so servers and fakes tell them from DESIGN §3's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from consolidation.errors import InvalidLLMOutput
from consolidation.llm.prompts import MAX_OBSERVATION_CHARS, Chat

CONTRACT = "v2"
DECIDE = "decide"
REWRITE = "rewrite"
CONFIRM = "confirm"
YES = "yes"
NO = "no"
NEW = "new"
SAME = "same"
UPDATE = "update"

DECIDE_PROMPT = """\
You keep an AI agent's memory tidy. INPUT is one JSON object; its "facts" are new facts, each \
with a few "candidates": existing observations (refs starting with o) or earlier facts (refs \
starting with f) that may be about the same thing.

For EACH fact answer one of:
- "same:<ref>" when the fact says what that candidate says (a restatement, maybe in other words);
- "update:<ref>" when the fact is about the very same subject and person as that candidate and \
changes or adds to it (a new state, a changed plan or preference, a new detail of that one thing);
- "new" when no candidate is about the same specific subject. Sharing a name, a project or a \
place is NOT enough: two different things about one project are "new".

ANSWER with one JSON object mapping each fact ref to its answer, e.g. {"f3": "update:o1"}. \
Nothing else.
"""

REWRITE_PROMPT = """\
You keep an AI agent's memory tidy. INPUT is one JSON object: an existing "observation" and new \
"facts" that update it, oldest first, with the time each happened.

Write the observation's new text: keep what it said that is still true, add what the facts say, \
and when a fact changes a state say what was true before and what is true now, with the date. \
Use only words and details from the observation and the facts; never add anything else. One or \
two plain sentences.

ANSWER with one JSON object: {"text": "<the new text>"}. Nothing else.
"""

# The detail's two examples are the lane's bank's: without them the 1.5B model refused "My flat
# in Paris is close to the Canal Saint-Martin" of "I live in Paris, in the 11th arrondissement"
# and "My cat Miso turned 5 this year" of "I have a cat named Miso"; with them it also refuses
# more pairs that only share a word. "A thing of the same kind" keeps two wholesalers apart,
# which the detail alone joined (docs/quality.md, "A detail of the same thing").
CONFIRM_PROMPT = """\
You keep an AI agent's memory tidy. INPUT is one JSON object with an existing "observation" and \
a new "fact". Answer "yes" when the fact is about the same thing as the observation: it restates \
it, adds a detail to that same thing (what the home it names is near, how old the pet it names \
is), or replaces it with a new state (a new job replaces the old job, a new home the old home, a \
new date the old date of the same event). Answer "no" when the fact is about something else, \
even if it names the same person, project or place or a thing of the same kind: a project's \
database is not its language, its budget is not its launch, two people called Anna are two \
people. A system's different aspects (what it is written in, who owns it, where it stores data, \
when it runs, how long it keeps things) are different things.

ANSWER with one JSON object: {"same_subject": "yes"} or {"same_subject": "no"}. Nothing else.
"""

# What a change ends beside the observation it updates (narrow.made_stale) is asked as a change.
# Of the banks' 6 observations that state the very value a change replaces, the 1.5B model says
# yes to 1 asked whether the change is "about the same thing", and to 4 asked whether the
# observation now holds an old value (docs/quality.md, "Asked as of a change").
CHANGE_CONFIRM_PROMPT = """\
You keep an AI agent's memory tidy. INPUT is one JSON object with an existing "observation" and \
a new "fact" that reports a change: something moved, was replaced, switched, rose, was \
postponed or started anew. Answer "yes" when the change is to the very thing the observation \
states, so that the observation now holds an old value: a new job replaces the old job, a new \
home the old home, a new version, tool or supplier the old one, a new date or price the old \
one of the same event or item. Answer "no" when the change is to something else, even if it \
names the same person, project or place: a project's new database does not change its \
language, a new launch date does not change its budget, two people called Anna are two people.

ANSWER with one JSON object: {"same_subject": "yes"} or {"same_subject": "no"}. Nothing else.
"""

# Answers are short: a decision is a few tokens per fact, a rewrite one or two sentences.
DECIDE_MAX_TOKENS_BASE = 32
DECIDE_MAX_TOKENS_PER_FACT = 16
REWRITE_MAX_TOKENS = 512
CONFIRM_MAX_TOKENS = 16

_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Shown:
    """A text shown to the model under a ref: a fact or an observation."""

    ref: str
    text: str
    at: str | None = None  # when it happened (a fact) or was last updated, ISO 8601 UTC


@dataclass(frozen=True)
class Question:
    """One fact of a decide request and the candidates it may be the same as or update."""

    fact: Shown
    candidates: tuple[Shown, ...]

    def choices(self) -> tuple[str, ...]:
        """The answers the schema allows for this fact, ``new`` first."""
        return (
            NEW,
            *(f"{kind}:{c.ref}" for c in self.candidates for kind in (SAME, UPDATE)),
        )


@dataclass(frozen=True)
class Decision:
    """What the model said of one fact: ``kind`` is new, same or update; ``target`` a ref."""

    kind: str
    target: str | None = None


def object_schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _head(bank: str, scope: Sequence[str], mission: str | None, task: str) -> dict[str, Any]:
    head: dict[str, Any] = {"contract": CONTRACT, "task": task, "bank": bank, "scope": list(scope)}
    if mission:
        head["mission"] = mission
    return head


def decide_chat(
    bank: str, scope: Sequence[str], mission: str | None, questions: Sequence[Question]
) -> Chat:
    """The decide request for ``questions``: each fact's answer pinned to its own choices."""
    payload = _head(bank, scope, mission, DECIDE)
    # No dates, here or in a confirm: the question is about subjects, the candidates carry none,
    # and an ISO timestamp is some 25 tokens (the tokenizer splits digits) in every call.
    payload["facts"] = [
        {
            "ref": q.fact.ref,
            "text": q.fact.text,
            "candidates": [{"ref": c.ref, "text": c.text} for c in q.candidates],
        }
        for q in questions
    ]
    schema = object_schema(
        {q.fact.ref: {"type": "string", "enum": list(q.choices())} for q in questions}
    )
    return Chat(
        system=DECIDE_PROMPT,
        user=orjson.dumps(payload).decode(),
        schema=schema,
        max_tokens=DECIDE_MAX_TOKENS_BASE + DECIDE_MAX_TOKENS_PER_FACT * len(questions),
    )


def _day(at: str | None) -> str | None:
    """The date of an ISO 8601 time: "2026-03-01T09:00:00Z" is "2026-03-01"."""
    return at[:10] if at else at


def rewrite_chat(
    bank: str,
    scope: Sequence[str],
    mission: str | None,
    observation: Shown,
    facts: Sequence[Shown],
) -> Chat:
    """The rewrite request of one observation updated by ``facts`` (oldest first)."""
    payload = _head(bank, scope, mission, REWRITE)
    # Dates only: a time of day is some 10 tokens (the tokenizer splits digits) that no text
    # needs, the guards allow only the date's words, and the observation's time of writing
    # would make two runs with the same decisions ask differently.
    payload["observation"] = {"text": observation.text, "updated_at": _day(observation.at)}
    payload["facts"] = [{"ref": f.ref, "text": f.text, "occurred_at": _day(f.at)} for f in facts]
    return Chat(
        system=REWRITE_PROMPT,
        user=orjson.dumps(payload).decode(),
        schema=object_schema({"text": {"type": "string"}}),
        max_tokens=REWRITE_MAX_TOKENS,
    )


def confirm_chat(
    bank: str,
    scope: Sequence[str],
    mission: str | None,
    fact: Shown,
    candidate: Shown,
    *,
    of_change: bool = False,
) -> Chat:
    """The confirm request: is ``fact`` about the same subject as ``candidate``, yes or no;
    ``of_change``: does the change ``fact`` reports leave ``candidate`` holding an old value."""
    payload = _head(bank, scope, mission, CONFIRM)
    payload["observation"] = {"text": candidate.text}
    payload["fact"] = {"text": fact.text}
    return Chat(
        system=CHANGE_CONFIRM_PROMPT if of_change else CONFIRM_PROMPT,
        user=orjson.dumps(payload).decode(),
        schema=object_schema({"same_subject": {"type": "string", "enum": [YES, NO]}}),
        max_tokens=CONFIRM_MAX_TOKENS,
    )


def _load(content: str) -> object:
    text = content.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        problem = f"the answer is not valid JSON ({exc})"
        raise InvalidLLMOutput(
            f"invalid answer: {problem}", answer=content, problems=[problem]
        ) from None


def parse_decisions(content: str, questions: Sequence[Question]) -> dict[str, Decision]:
    """The decision of every fact of ``questions``, by fact ref. Raises InvalidLLMOutput when the
    answer is not one object, misses a fact or gives one an answer outside its choices."""
    answer = _load(content)
    problems: list[str] = []
    decisions: dict[str, Decision] = {}
    if not isinstance(answer, dict):
        problems.append("the answer must be a JSON object mapping each fact ref to its answer")
        answer = {}
    for question in questions:
        ref = question.fact.ref
        value = answer.get(ref)
        if not isinstance(value, str) or value not in question.choices():
            allowed = ", ".join(question.choices())
            problems.append(f"{ref}: {value!r} is not one of {allowed}")
            continue
        kind, _, target = value.partition(":")
        decisions[ref] = Decision(kind, target or None)
    unknown = sorted(set(answer) - {q.fact.ref for q in questions})
    if unknown:
        problems.append(f"unknown fact refs {unknown}")
    if problems:
        raise InvalidLLMOutput(
            "invalid decide answer: " + "; ".join(problems[:10]), answer=content, problems=problems
        )
    return decisions


def parse_rewrite(content: str) -> str:
    """The text of a rewrite answer. Raises InvalidLLMOutput if there is no usable one."""
    answer = _load(content)
    text = answer.get("text") if isinstance(answer, dict) else None
    if not isinstance(text, str) or not text.strip():
        problem = 'the answer must be {"text": "<the new text>"} with a non-empty text'
        raise InvalidLLMOutput(f"invalid answer: {problem}", answer=content, problems=[problem])
    text = " ".join(text.split())
    if len(text) > MAX_OBSERVATION_CHARS:
        problem = f"the text has {len(text)} characters, more than {MAX_OBSERVATION_CHARS}"
        raise InvalidLLMOutput(f"invalid answer: {problem}", answer=content, problems=[problem])
    return text


def parse_confirm(content: str) -> bool:
    """Whether a confirm answer says yes. Raises InvalidLLMOutput if it is neither."""
    answer = _load(content)
    value = answer.get("same_subject") if isinstance(answer, dict) else None
    if value != YES and value != NO:
        problem = 'the answer must be {"same_subject": "yes"} or {"same_subject": "no"}'
        raise InvalidLLMOutput(f"invalid answer: {problem}", answer=content, problems=[problem])
    return bool(value == YES)


def is_v2_request(request: Mapping[str, Any]) -> bool:
    """Whether a parsed user object is a v2 request (rather than DESIGN §3's)."""
    return request.get("contract") == CONTRACT
