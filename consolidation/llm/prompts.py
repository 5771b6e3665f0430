"""The LLM wire contract (DESIGN §3): the one place that builds prompts and parses answers. Pure.

The model only ever sees short refs (``f1``, ``o1``); :class:`PassRequest` remembers which id
each ref stands for and :func:`parse_answer` maps them back, rejecting anything it cannot trust.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
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

INPUT is one JSON object with these keys: "bank" and "scope" (where the memories live), \
"mission" (what the agent is for, or null), "facts" (the new facts, each with a "ref", its \
"text", its "tags" and "occurred_at", the time the event happened or null) and "observations" \
(the existing observations, each with a "ref", its "text", "sources", the number of facts \
behind it, and "updated_at"). Fact refs start with the letter f, observation refs with the \
letter o.

ANSWER with exactly one JSON object and nothing else (no prose, no markdown). It has three \
keys, "creates", "updates" and "merges", and each is a list of actions:
- a create adds a new observation. Its keys: "text", the full text you write, and "facts", \
the refs of the facts it is based on.
- an update rewrites an existing observation. Its keys: "observation", the ref of that \
observation; "text", its full new text, keeping everything it said that is still true; and \
"facts", the refs of the new facts it now includes.
- a merge joins existing observations that say the same thing. Its keys: "observations", the \
refs of two or more different observations (the first is kept, the others are removed); \
"text", the full text of the joined observation; and "facts", the refs of any new facts it \
includes (possibly none).
Copy refs exactly as the input spells them and use no other refs. Write every text yourself \
from the facts and observations: real sentences, never a placeholder. A list with nothing to \
do is empty.

RULES
1. Prefer updating an existing observation over creating a near-duplicate of it.
2. One facet per observation: a single topic, preference, relationship or state. Do not pile \
unrelated facts into one observation.
3. When a state changes, keep the history in the text: say what used to be true and what is \
true now, with the date when it is known. Use occurred_at to order events; newer facts win over \
older ones.
4. Never invent facts. Every statement in a text must come from the given facts or observations.
5. Cite in "facts" every fact an action is based on. Facts that add nothing new are simply not \
cited.
6. Merge observations that say the same thing instead of keeping duplicates.
7. Each observation ref appears in at most one update or merge, and at most once in it.
8. Texts are self-contained plain sentences, never empty, at most {MAX_OBSERVATION_CHARS} \
characters. Keep the mission in mind when deciding what matters.
9. If nothing needs to change, answer with all three lists empty.
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
    shown: tuple[str, ...] = ()  # the facts' and observations' texts, as the model saw them

    @functools.cached_property
    def input_texts(self) -> frozenset[str]:
        """The texts the model was shown, whitespace collapsed: repeating them is never a
        placeholder. Worked out only for an answer text that looks like one."""
        return frozenset(_collapsed(text) for text in self.shown)


def _collapsed(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=4096)  # an observation's time comes back with every recall
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
        shown=(*(f.text for f in facts), *(o.text for o in observations)),
    )


# Only keywords that OpenAI's strict structured outputs, vLLM's guided decoding and llama.cpp's
# grammar compiler all accept (type, properties, required, additionalProperties, items, enum,
# description): no length bounds and never an empty enum. What the schema cannot say (text
# lengths, a merge of two or more, each observation used once) parse_answer enforces.
_SCHEMA_NAME = "consolidation_actions"
_TEXT = {
    "type": "string",
    "description": f"Full observation text, non-empty, at most {MAX_OBSERVATION_CHARS} characters.",
}


def _refs(refs: Sequence[str], description: str) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "string"}
    if refs:
        item["enum"] = list(refs)
    return {"type": "array", "items": item, "description": description}


def _action(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        },
    }


def response_schema(request: PassRequest) -> dict[str, Any]:
    """The answer's JSON schema for one pass, its refs pinned: ``facts`` items are the pass's
    fact refs and observation fields its observation refs, so constrained decoding cannot
    produce an unknown ref. Without observations the schema has no updates or merges."""
    facts = _refs(list(request.fact_refs), "Refs of the facts this action is based on.")
    properties: dict[str, Any] = {"creates": _action({"text": _TEXT, "facts": facts})}
    observation_refs = list(request.observation_refs)
    if observation_refs:
        properties["updates"] = _action(
            {
                "observation": {
                    "type": "string",
                    "enum": observation_refs,
                    "description": "Ref of the observation to rewrite.",
                },
                "text": _TEXT,
                "facts": facts,
            }
        )
        properties["merges"] = _action(
            {
                "observations": _refs(
                    observation_refs,
                    "Two or more different observation refs; the first is kept, the others "
                    "are removed.",
                ),
                "text": _TEXT,
                "facts": facts,
            }
        )
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


# The forms of ``response_format`` in the order ``auto`` tries them: OpenAI's json_schema, the
# json_object-with-schema form llama.cpp-family servers constrain decoding with, plain JSON mode.
RESPONSE_FORMATS = ("json_schema", "json_object+schema", "json_object")


def response_format(form: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The ``response_format`` body field of one of :data:`RESPONSE_FORMATS`."""
    if form == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": _SCHEMA_NAME, "strict": True, "schema": schema},
        }
    if form == "json_object+schema":
        return {"type": "json_object", "schema": schema}
    if form == "json_object":
        return {"type": "json_object"}
    raise ValueError(f"unknown response format {form!r}; expected one of {RESPONSE_FORMATS}")


# max_tokens of a pass: room for one full-length observation rewrite plus a share per fact.
# The client caps it with CONSOLIDATION_LLM_MAX_TOKENS.
MAX_TOKENS_BASE = 1024
MAX_TOKENS_PER_FACT = 256
# A repair echoes at most this much of the unusable answer back to the model.
MAX_REPAIR_ECHO_CHARS = 16_000
SYSTEM_ROLES = ("system", "user")


@dataclass(frozen=True)
class Chat:
    """One chat-completion request of a pass: the instructions, the DESIGN §3 user object, the
    turns of a repair after them, the answer's schema and the ``max_tokens`` the pass may need
    (before the client's cap)."""

    system: str
    user: str
    schema: Mapping[str, Any]
    max_tokens: int
    turns: tuple[tuple[str, str], ...] = ()

    @property
    def repair(self) -> bool:
        """Whether this request carries a previous answer and its problems."""
        return bool(self.turns)

    @property
    def prompt_chars(self) -> int:
        return len(self.system) + len(self.user) + sum(len(text) for _, text in self.turns)

    def messages(self, system_role: str = "system") -> list[dict[str, str]]:
        """The ``messages`` of the request. With ``system_role="user"`` (for chat templates that
        drop the system message) the instructions open the first user message, which still ends
        with the §3 object on its own line."""
        if system_role == "system":
            head = [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self.user},
            ]
        elif system_role == "user":
            head = [{"role": "user", "content": f"{self.system}\n\n{self.user}"}]
        else:
            raise ValueError(f"unknown system role {system_role!r}; expected one of {SYSTEM_ROLES}")
        return head + [{"role": role, "content": text} for role, text in self.turns]


def pass_chat(request: PassRequest) -> Chat:
    """The first request of a pass: system prompt, §3 user object, pinned schema, max_tokens."""
    return Chat(
        system=SYSTEM_PROMPT,
        user=request.user_content,
        schema=response_schema(request),
        max_tokens=MAX_TOKENS_BASE + MAX_TOKENS_PER_FACT * len(request.fact_refs),
    )


def repair_chat(chat: Chat, error: InvalidLLMOutput) -> Chat:
    """The retry of ``chat`` after ``error``: the unusable answer goes back as the assistant's
    turn, followed by a short user turn listing its problems and asking for a corrected object
    (with twice the ``max_tokens`` when the answer was cut off). Without an answer to show (an
    empty one, a rejected request) the retry is ``chat`` itself."""
    answer = (error.answer or "").strip()
    if not answer:
        return chat
    if len(answer) > MAX_REPAIR_ECHO_CHARS:
        more = len(answer) - MAX_REPAIR_ECHO_CHARS
        answer = f"{answer[:MAX_REPAIR_ECHO_CHARS]}… [{more} more characters]"
    problems = error.problems or (str(error),)
    note = (
        "That answer cannot be used:\n"
        + "".join(f"- {problem}\n" for problem in problems)
        + "Answer again with one corrected JSON object in the same format: only refs from the "
        "input, each observation at most once, every text written in full from the facts."
    )
    return dataclasses.replace(
        chat,
        turns=(("assistant", answer), ("user", note)),
        max_tokens=chat.max_tokens * 2 if error.truncated else chat.max_tokens,
    )


def find_request_object(content: str) -> dict[str, Any] | None:
    """The DESIGN §3 object of a user message: the whole content, or its last line when
    instructions come first (``CONSOLIDATION_LLM_SYSTEM_ROLE=user``); None if there is none."""
    for candidate in (content, content.rstrip().rpartition("\n")[2]):
        try:
            found = orjson.loads(candidate)
        except orjson.JSONDecodeError:
            continue
        if isinstance(found, dict):
            return found
    return None


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
        elif is_placeholder(text) and not self._from_input(text):
            self.problems.append(
                f"{where}.text {text!r} is a placeholder, not an observation; write the full text"
            )
        return text

    def _from_input(self, text: str) -> bool:
        """Whether every word of ``text`` stands in a text the model was shown: a fact or an
        observation that says little is not a placeholder when repeated, or combined. A word
        may end with a full stop the combination added (".:" joined as ".:."), but punctuation
        alone ("...") must itself have been shown."""
        shown = self.request.input_texts
        return all(
            any((word.rstrip(".!?") or word) in given for given in shown) for word in text.split()
        )

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


# Normalised texts that models copy from format descriptions instead of writing an observation.
_PLACEHOLDERS = frozenset(
    {
        "text",
        "string",
        "placeholder",
        "observation",
        "observation text",
        "full text",
        "new text",
        "updated text",
        "merged text",
        "full observation text",
        "your text here",
        "text here",
        "example",
        "todo",
        "tbd",
        "n/a",
        "lorem ipsum",
    }
)
_REF_LIKE = re.compile(r"[fo]\d+", re.IGNORECASE)
# What separates the words of a placeholder: anything but letters, digits and "/" ("n/a").
_NOT_WORD = re.compile(r"[^\w/]|_")
_WORD_RUN = re.compile(r"(?:[^\W_]|/)+")
_PLACEHOLDER_CHARS = max(map(len, _PLACEHOLDERS))
# Letters, digits and other symbols (emoji) carry meaning; punctuation and spaces alone do not.
_MEANINGFUL_CATEGORIES = ("L", "N", "So")


def is_placeholder(text: str) -> bool:
    """Whether ``text`` says nothing: punctuation only (``"..."``, ``"—"``), a format word
    (``"text"``, ``"<observation text>"``) or a ref (``"f1"``)."""
    if not any(unicodedata.category(ch).startswith(_MEANINGFUL_CATEGORIES) for ch in text):
        return True
    # Two words or more that are longer together than any placeholder: neither a placeholder
    # nor a ref. Decided within the first words of an observation, not over all its text.
    length = -1
    for count, run in enumerate(_WORD_RUN.finditer(text), start=1):
        length += len(run.group()) + 1
        if count >= 2 and length > _PLACEHOLDER_CHARS:
            return False
    words = " ".join(_NOT_WORD.sub(" ", text).split())
    return words.lower() in _PLACEHOLDERS or _REF_LIKE.fullmatch(words) is not None


def _unusable(problem: str, answer: str) -> InvalidLLMOutput:
    return InvalidLLMOutput(f"invalid answer: {problem}", answer=answer, problems=[problem])


def _decode(content: str | bytes) -> tuple[str, object]:
    if isinstance(content, bytes):
        try:
            content = content.decode()
        except UnicodeDecodeError as exc:
            raise InvalidLLMOutput(f"answer is not valid UTF-8: {exc}") from None
    text = content.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        return content, orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        preview = text[:80] + ("…" if len(text) > 80 else "")
        raise _unusable(f"the answer is not valid JSON ({exc}): {preview!r}", content) from None


def parse_answer(content: str | bytes, request: PassRequest) -> PassPlan:
    """Validate an assistant answer against ``request`` and map its refs back to ids.

    Raises :class:`InvalidLLMOutput` naming every problem found (and carrying the answer, so a
    retry can show the model what to correct); never returns an id that was not in the request.
    """
    answer_text, answer = _decode(content)
    if not isinstance(answer, dict):
        raise _unusable(f"the answer must be a JSON object, got {_json_type(answer)}", answer_text)
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
                seen: set[str] = set()
                for j, ref in enumerate(refs):
                    if isinstance(ref, str):
                        if ref in seen:
                            check.problems.append(
                                f"{where}.observations lists {ref!r} twice; "
                                "a merge needs two or more different observations"
                            )
                            continue
                        seen.add(ref)
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
        raise InvalidLLMOutput(
            "invalid answer: " + "; ".join(shown) + suffix, answer=answer_text, problems=shown
        )
    return PassPlan(creates=tuple(creates), updates=tuple(updates), merges=tuple(merges))
