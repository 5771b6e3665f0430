"""What the fake understood of a chat-completion request: the model, the §3 object of the first
user message, the response format, the token bound and the messages (``_Parsed``, ``_parse``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import orjson

from consolidation.llm import prompts


@dataclass(frozen=True)
class _Parsed:
    """What the fake understood of one chat-completion request."""

    model: str
    user: dict[str, Any] | None
    bank: str | None
    scope: tuple[str, ...] | None
    fact_texts: tuple[str, ...]
    response_format: str | None
    problem: str | None
    schema: bool = False
    max_tokens: int | None = None
    # Which field carried the bound: max_tokens, max_completion_tokens or None.
    token_field: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    # Whether the first user message carries instructions before the §3 object.
    instructed_user: bool = False

    @property
    def turns(self) -> tuple[str, ...]:
        """The contents of the messages after the first user message (a repair's)."""
        roles = [role for role, _ in self.messages]
        if "user" not in roles:
            return ()
        return tuple(content for _, content in self.messages[roles.index("user") + 1 :])

    @property
    def repair(self) -> bool:
        """A previous answer and a note about it follow the first user message."""
        return bool(self.turns)


def _parse(body: bytes) -> _Parsed:
    """Read the request leniently; ``problem`` says why it cannot be answered (→ 400)."""
    model = "fake"
    user: dict[str, Any] | None = None
    response_format: str | None = None
    schema = False
    max_tokens: int | None = None
    token_field: str | None = None
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        request = None
    if not isinstance(request, dict):
        return _Parsed(model, None, None, None, (), None, "request body is not a JSON object")
    if isinstance(request.get("model"), str):
        model = request["model"]
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("type"), str):
        response_format = fmt["type"]
        inner = fmt.get("json_schema")
        schema = isinstance(fmt.get("schema"), dict) or (
            isinstance(inner, dict) and isinstance(inner.get("schema"), dict)
        )
    for field in ("max_tokens", "max_completion_tokens"):
        value = request.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            max_tokens, token_field = value, field
            break
    messages: list[tuple[str, str]] = []
    raw_messages = request.get("messages")
    for message in raw_messages if isinstance(raw_messages, list) else []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            messages.append((str(message.get("role")), message["content"]))
    # The §3 object is in the first user message; later ones are repair notes.
    user_content = next((content for role, content in messages if role == "user"), None)
    parsed = functools.partial(
        _Parsed,
        model=model,
        response_format=response_format,
        schema=schema,
        max_tokens=max_tokens,
        token_field=token_field,
        messages=tuple(messages),
    )
    if user_content is None:
        problem = "messages must contain a user message with string content"
        return parsed(user=None, bank=None, scope=None, fact_texts=(), problem=problem)
    # Parsed once: a user message that is the whole object carries no instructions.
    whole = _json_object(user_content)
    user = whole if whole is not None else prompts.find_request_object(user_content)
    if user is None:
        problem = "the user message content does not end with the JSON object of DESIGN §3"
        return parsed(user=None, bank=None, scope=None, fact_texts=(), problem=problem)
    bank = user.get("bank")
    scope = user.get("scope")
    facts = user.get("facts")
    return parsed(
        user=user,
        bank=bank if isinstance(bank, str) else None,
        scope=tuple(str(t) for t in scope) if isinstance(scope, list) else (),
        fact_texts=tuple(
            fact["text"]
            for fact in (facts if isinstance(facts, list) else [])
            if isinstance(fact, dict) and isinstance(fact.get("text"), str)
        ),
        problem=None,
        instructed_user=whole is None,
    )


def _observation_texts(user: dict[str, Any] | None) -> list[str]:
    """The texts of the observations a request showed (recorded with its call)."""
    shown = user.get("observations") if user is not None else None
    return [
        o["text"]
        for o in (shown if isinstance(shown, list) else [])
        if isinstance(o, dict) and isinstance(o.get("text"), str)
    ]


def _json_object(content: str) -> dict[str, Any] | None:
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
