"""The LLM wire contract (DESIGN §3): the one place that builds prompts and parses answers. Pure.

The model only ever sees short refs (``f1``, ``o1``); :class:`PassRequest` remembers which id
each ref stands for and :func:`parse_answer` maps them back, rejecting anything it cannot trust.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import orjson

from consolidation.errors import InvalidLLMOutput
from consolidation.scopes import Scope

MAX_OBSERVATION_CHARS = 4000

SYSTEM_PROMPT = f"""\
You consolidate an AI agent's memory. You receive new facts (atomic memories) and the existing \
observations of one scope of one memory bank. Observations are durable, consolidated knowledge \
built from facts. Decide how the new facts change the observations.

INPUT is one JSON object:
{{"bank": "...", "scope": ["tag", ...], "mission": "what the agent is for, or null",
 "facts": [{{"ref": "f1", "text": "...", "tags": ["..."], "occurred_at": "ISO-8601 or null"}}],
 "observations": [{{"ref": "o1", "text": "...", "sources": 3, "updated_at": "ISO-8601"}}]}}

ANSWER with exactly one JSON object and nothing else (no prose, no markdown):
{{"creates": [{{"text": "...", "facts": ["f1"]}}],
 "updates": [{{"observation": "o1", "text": "...", "facts": ["f2"]}}],
 "merges": [{{"observations": ["o1", "o2"], "text": "...", "facts": []}}]}}

- "creates": a new observation with its full text and the facts it is based on.
- "updates": replaces the full text of an existing observation, so keep everything it said that \
is still true; "facts" are the new facts it now includes.
- "merges": the listed observations (at least two) say the same thing; they become one \
observation with the given full text. The first one is kept, the others are removed.
- Any key may be omitted or an empty list. Use only refs that appear in the input.

RULES
1. Prefer updating an existing observation over creating a near-duplicate of it.
2. One facet per observation: a single topic, preference, relationship or state. Do not pile \
unrelated facts into one observation.
3. When a state changes, keep the history in the text, e.g. "used to live in Paris, now lives in \
Berlin (since 2026-01)". Use occurred_at to order events; newer facts win over older ones.
4. Never invent facts. Every statement in a text must come from the given facts or observations.
5. Cite in "facts" every fact an action is based on. Facts that add nothing new are simply not \
cited.
6. Merge observations that say the same thing instead of keeping duplicates.
7. Each observation ref appears in at most one update or merge.
8. Texts are self-contained plain sentences, never empty, at most {MAX_OBSERVATION_CHARS} \
characters. Keep the mission in mind when deciding what matters.
9. If nothing needs to change, answer {{"creates": [], "updates": [], "merges": []}}.
"""


@dataclass(frozen=True)
class FactInput:
    """A memory as shown to the model in one pass."""

    memory_id: UUID
    text: str
    tags: tuple[str, ...]
    occurred_at: datetime | None


@dataclass(frozen=True)
class ObservationInput:
    """An existing observation recalled for one pass."""

    observation_id: UUID
    text: str
    sources: int
    updated_at: datetime


@dataclass(frozen=True)
class PassRequest:
    """The user message of one pass plus the refs it introduced, in order."""

    user_content: str
    fact_refs: Mapping[str, UUID]
    observation_refs: Mapping[str, UUID]


def _utc_iso(value: datetime) -> str:
    # Naive datetimes come from the database as UTC; seconds are all the model needs.
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


def build_request(
    bank_id: str,
    scope: Scope,
    mission: str | None,
    facts: Sequence[FactInput],
    observations: Sequence[ObservationInput],
) -> PassRequest:
    """Build the user message of DESIGN §3; facts become ``f1…``, observations ``o1…``."""
    fact_refs = {f"f{i}": fact.memory_id for i, fact in enumerate(facts, start=1)}
    observation_refs = {f"o{i}": obs.observation_id for i, obs in enumerate(observations, start=1)}
    payload = {
        "bank": bank_id,
        "scope": list(scope),
        "mission": mission,
        "facts": [
            {
                "ref": ref,
                "text": fact.text,
                "tags": list(fact.tags),
                "occurred_at": None if fact.occurred_at is None else _utc_iso(fact.occurred_at),
            }
            for ref, fact in zip(fact_refs, facts, strict=True)
        ],
        "observations": [
            {
                "ref": ref,
                "text": obs.text,
                "sources": obs.sources,
                "updated_at": _utc_iso(obs.updated_at),
            }
            for ref, obs in zip(observation_refs, observations, strict=True)
        ],
    }
    return PassRequest(
        user_content=orjson.dumps(payload).decode(),
        fact_refs=fact_refs,
        observation_refs=observation_refs,
    )


def _string_array(description: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string"}, "description": description}


_TEXT = {
    "type": "string",
    "description": f"Full observation text, non-empty, at most {MAX_OBSERVATION_CHARS} characters.",
}
_FACTS = _string_array("Refs of the facts (f1, f2, ...) this action is based on.")

# Only keywords that OpenAI's structured outputs, vLLM and llama.cpp grammars all accept;
# lengths and ref validity are enforced by parse_answer instead.
RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "creates": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"text": _TEXT, "facts": _FACTS},
                "required": ["text", "facts"],
                "additionalProperties": False,
            },
        },
        "updates": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "observation": {"type": "string", "description": "Ref (o1, ...) to update."},
                    "text": _TEXT,
                    "facts": _FACTS,
                },
                "required": ["observation", "text", "facts"],
                "additionalProperties": False,
            },
        },
        "merges": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "observations": _string_array(
                        "At least two observation refs; the first is kept, the others removed."
                    ),
                    "text": _TEXT,
                    "facts": _FACTS,
                },
                "required": ["observations", "text", "facts"],
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}


def response_format(mode: str) -> dict[str, Any]:
    """The ``response_format`` body field for ``json_schema`` or ``json_object`` mode."""
    if mode == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {
                "name": "consolidation_actions",
                "schema": copy.deepcopy(RESPONSE_SCHEMA),
            },
        }
    if mode == "json_object":
        return {"type": "json_object"}
    raise ValueError(
        f"unknown response format mode {mode!r}; expected 'json_schema' or 'json_object'"
    )


@dataclass(frozen=True)
class CreateAction:
    """Create a new observation supported by ``memory_ids``."""

    text: str
    memory_ids: tuple[UUID, ...]


@dataclass(frozen=True)
class UpdateAction:
    """Replace the text of an observation and add ``memory_ids`` to its sources."""

    observation_id: UUID
    text: str
    memory_ids: tuple[UUID, ...]


@dataclass(frozen=True)
class MergeAction:
    """Merge observations into the first one (new text, union of sources); remove the others."""

    observation_ids: tuple[UUID, ...]
    text: str
    memory_ids: tuple[UUID, ...]


@dataclass(frozen=True)
class PassPlan:
    """A validated answer, with every ref already mapped back to its id."""

    creates: tuple[CreateAction, ...]
    updates: tuple[UpdateAction, ...]
    merges: tuple[MergeAction, ...]

    def action_of(self, memory_id: UUID) -> str:
        """What this answer did with a fact (DESIGN §2): ``created``, ``updated`` or ``merged``
        when one action cites it, ``multiple`` when several do, ``skipped`` when none does."""
        kinds = [
            kind
            for kind, actions in (
                ("created", self.creates),
                ("updated", self.updates),
                ("merged", self.merges),
            )
            for action in actions
            if memory_id in action.memory_ids
        ]
        if len(kinds) > 1:
            return "multiple"
        return kinds[0] if kinds else "skipped"

    def citations(self) -> dict[UUID, int]:
        """How many actions cite each memory (memories cited by none are absent)."""
        counts: dict[UUID, int] = {}
        actions: list[CreateAction | UpdateAction | MergeAction] = [
            *self.creates,
            *self.updates,
            *self.merges,
        ]
        for action in actions:
            for memory_id in action.memory_ids:
                counts[memory_id] = counts.get(memory_id, 0) + 1
        return counts


_TOP_LEVEL_KEYS = ("creates", "updates", "merges")
_ACTION_KEYS = {
    "creates": frozenset({"text", "facts"}),
    "updates": frozenset({"observation", "text", "facts"}),
    "merges": frozenset({"observations", "text", "facts"}),
}
# Some local models wrap the object in a markdown fence despite the instructions.
_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.DOTALL | re.IGNORECASE)
_MAX_REPORTED_PROBLEMS = 10


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


class _AnswerChecker:
    """Accumulates every problem of one answer so the error message names them all."""

    def __init__(self, request: PassRequest) -> None:
        self.request = request
        self.problems: list[str] = []
        self.observation_uses: dict[str, str] = {}

    def text(self, where: str, value: object) -> str:
        if not isinstance(value, str):
            self.problems.append(f"{where}.text must be a string, got {_json_type(value)}")
            return ""
        text = value.strip()
        if not text:
            self.problems.append(f"{where}.text is empty")
        elif len(text) > MAX_OBSERVATION_CHARS:
            self.problems.append(
                f"{where}.text has {len(text)} characters, more than {MAX_OBSERVATION_CHARS}"
            )
        return text

    def facts(self, where: str, value: object) -> tuple[UUID, ...]:
        if not isinstance(value, list):
            self.problems.append(f"{where}.facts must be an array, got {_json_type(value)}")
            return ()
        # A fact cited twice in one action (or two refs to one memory) counts once.
        ids: dict[UUID, None] = {}
        for i, ref in enumerate(value):
            if not isinstance(ref, str):
                self.problems.append(f"{where}.facts[{i}] must be a string, got {_json_type(ref)}")
            elif ref not in self.request.fact_refs:
                self.problems.append(f"{where}.facts[{i}]: unknown fact ref {ref!r}")
            else:
                ids[self.request.fact_refs[ref]] = None
        return tuple(ids)

    def observation(self, where: str, value: object) -> UUID | None:
        if not isinstance(value, str):
            self.problems.append(f"{where} must be a string, got {_json_type(value)}")
            return None
        if value not in self.request.observation_refs:
            self.problems.append(f"{where}: unknown observation ref {value!r}")
            return None
        previous = self.observation_uses.get(value)
        if previous is not None:
            self.problems.append(
                f"{where}: observation ref {value!r} is already used by {previous}; "
                "each observation may appear in at most one update or merge"
            )
            return None
        self.observation_uses[value] = where
        return self.request.observation_refs[value]

    def action(self, key: str, where: str, item: object) -> dict[str, Any] | None:
        if not isinstance(item, dict):
            self.problems.append(f"{where} must be an object, got {_json_type(item)}")
            return None
        expected = _ACTION_KEYS[key]
        unknown = sorted(set(item) - expected)
        missing = sorted(expected - set(item))
        if unknown:
            self.problems.append(f"{where} has unknown keys {unknown}")
        if missing:
            self.problems.append(f"{where} is missing keys {missing}")
        return None if unknown or missing else item


def _decode(content: str | bytes) -> object:
    if isinstance(content, bytes):
        try:
            content = content.decode()
        except UnicodeDecodeError as exc:
            raise InvalidLLMOutput(f"answer is not valid UTF-8: {exc}") from None
    content = content.strip()
    fenced = _FENCE.match(content)
    if fenced:
        content = fenced.group(1)
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        preview = content[:80] + ("…" if len(content) > 80 else "")
        raise InvalidLLMOutput(f"answer is not valid JSON ({exc}): {preview!r}") from None


def parse_answer(content: str | bytes, request: PassRequest) -> PassPlan:
    """Validate an assistant answer against ``request`` and map its refs back to ids.

    Raises :class:`InvalidLLMOutput` naming every problem found; never returns an id that
    was not in the request.
    """
    answer = _decode(content)
    if not isinstance(answer, dict):
        raise InvalidLLMOutput(f"answer must be a JSON object, got {_json_type(answer)}")
    check = _AnswerChecker(request)
    unknown = sorted(set(answer) - set(_TOP_LEVEL_KEYS))
    if unknown:
        check.problems.append(
            f"unknown top-level keys {unknown}; expected only {list(_TOP_LEVEL_KEYS)}"
        )
    sections: dict[str, list[Any]] = {}
    for key in _TOP_LEVEL_KEYS:
        value = answer.get(key, [])
        if isinstance(value, list):
            sections[key] = value
        else:
            check.problems.append(f"{key} must be an array, got {_json_type(value)}")
            sections[key] = []

    creates: list[CreateAction] = []
    for i, raw in enumerate(sections["creates"]):
        where = f"creates[{i}]"
        if (item := check.action("creates", where, raw)) is not None:
            text = check.text(where, item["text"])
            creates.append(CreateAction(text=text, memory_ids=check.facts(where, item["facts"])))

    updates: list[UpdateAction] = []
    for i, raw in enumerate(sections["updates"]):
        where = f"updates[{i}]"
        if (item := check.action("updates", where, raw)) is not None:
            observation_id = check.observation(f"{where}.observation", item["observation"])
            text = check.text(where, item["text"])
            memory_ids = check.facts(where, item["facts"])
            if observation_id is not None:
                updates.append(UpdateAction(observation_id, text, memory_ids))

    merges: list[MergeAction] = []
    for i, raw in enumerate(sections["merges"]):
        where = f"merges[{i}]"
        if (item := check.action("merges", where, raw)) is not None:
            refs = item["observations"]
            observation_ids: list[UUID] = []
            if not isinstance(refs, list):
                check.problems.append(
                    f"{where}.observations must be an array, got {_json_type(refs)}"
                )
            else:
                if len(refs) < 2:
                    check.problems.append(
                        f"{where}.observations lists {len(refs)} observation(s); "
                        "a merge needs at least two"
                    )
                for j, ref in enumerate(refs):
                    found = check.observation(f"{where}.observations[{j}]", ref)
                    if found is not None:
                        observation_ids.append(found)
            text = check.text(where, item["text"])
            memory_ids = check.facts(where, item["facts"])
            merges.append(MergeAction(tuple(observation_ids), text, memory_ids))

    if check.problems:
        shown = check.problems[:_MAX_REPORTED_PROBLEMS]
        more = len(check.problems) - len(shown)
        suffix = f"; and {more} more" if more else ""
        raise InvalidLLMOutput("invalid answer: " + "; ".join(shown) + suffix)
    return PassPlan(creates=tuple(creates), updates=tuple(updates), merges=tuple(merges))
