"""Validation of incoming memories — one set of rules for the API and ``consolidation ingest``."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from consolidation.errors import ValidationError
from consolidation.scopes import (
    MAX_TAGS,
    Scope,
    observation_scopes_problems,
    tag_problem,
    write_scopes,
)

MAX_TEXT_CHARS = 8000
MAX_BANK_ID_CHARS = 256
MAX_METADATA_BYTES = 16_384
MIN_TIMESTAMP = datetime(1900, 1, 1, tzinfo=UTC)
MAX_TIMESTAMP = datetime(9999, 12, 30, tzinfo=UTC)
FIELDS = frozenset({"id", "text", "tags", "observation_scopes", "occurred_at", "metadata"})


@dataclass(frozen=True)
class NewMemory:
    """A memory that passed validation, with its write scopes resolved."""

    id: uuid.UUID
    text: str
    tags: tuple[str, ...]
    observation_scopes: str | list[list[str]] | None
    occurred_at: datetime | None
    metadata: dict[str, Any]
    scopes: tuple[Scope, ...]


def bank_id_problems(bank_id: str) -> list[str]:
    """[] when ``bank_id`` is usable as a bank id."""
    if not bank_id or not bank_id.strip():
        return ["bank id must not be empty"]
    if len(bank_id) > MAX_BANK_ID_CHARS:
        return [f"bank id is longer than {MAX_BANK_ID_CHARS} characters"]
    if any(ord(c) < 32 for c in bank_id):
        return ["bank id must not contain control characters"]
    return []


def parse_timestamp(value: object) -> datetime:
    """An ISO-8601 timestamp (``Z`` accepted); naive values are taken as UTC."""
    if not isinstance(value, str):
        raise ValueError("must be an ISO-8601 timestamp string")
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00").replace("z", "+00:00"))
        parsed = parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
        # Values whose UTC form leaves years 1..9999 are stored by Postgres but cannot be read
        # back into Python, which would wedge every later wave of the bank.
        utc = parsed.astimezone(UTC)
    except (ValueError, OverflowError):
        raise ValueError(
            f"is not an ISO-8601 timestamp between years 1 and 9999: {value!r}"
        ) from None
    if not MIN_TIMESTAMP <= utc <= MAX_TIMESTAMP:
        raise ValueError(f"is outside the supported range (years 1900 to 9999): {value!r}")
    return utc


def _tag_problems(tags: object) -> list[str]:
    if not isinstance(tags, list):
        return ["tags must be a list of strings"]
    problems = []
    if len(tags) > MAX_TAGS:
        problems.append(f"at most {MAX_TAGS} tags are allowed, got {len(tags)}")
    for index, tag in enumerate(tags):
        problem = tag_problem(tag)
        if problem:
            problems.append(f"tags[{index}] {problem}")
    return problems


def _metadata_problems(metadata: dict[str, Any]) -> list[str]:
    try:
        encoded = orjson.dumps(metadata)
    except (TypeError, orjson.JSONEncodeError) as exc:
        return [f"metadata cannot be stored as JSON ({exc})"]
    if len(encoded) > MAX_METADATA_BYTES:
        return [
            f"metadata is {len(encoded)} bytes as JSON, at most {MAX_METADATA_BYTES} are allowed"
        ]
    if b"\\u0000" in encoded:  # Postgres jsonb cannot store NUL
        return ["metadata must not contain NUL characters"]
    return []


def parse_memory(obj: object, default_id: uuid.UUID | None = None) -> NewMemory:
    """Validate one memory object; raises ValidationError listing every problem found.

    Without an ``id`` the memory gets ``default_id``, else a random UUID.
    """
    if not isinstance(obj, Mapping):
        raise ValidationError("a memory must be a JSON object")
    problems: list[str] = []
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        problems.append(f"unknown field(s): {', '.join(map(str, unknown))}")

    memory_id = default_id or uuid.uuid4()
    raw_id = obj.get("id")
    if raw_id is not None:
        try:
            memory_id = uuid.UUID(str(raw_id)) if isinstance(raw_id, str) else _bad_id()
        except ValueError:
            problems.append(f"id must be a UUID, got {raw_id!r}")

    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        problems.append("text must be a non-empty string")
        text = ""
    elif len(text) > MAX_TEXT_CHARS:
        problems.append(f"text is {len(text)} characters, at most {MAX_TEXT_CHARS} are allowed")
    elif "\x00" in text:
        problems.append("text must not contain NUL characters")

    tags = obj.get("tags")
    if tags is None:
        tags = []
    tag_problems = _tag_problems(tags)
    problems += tag_problems
    if tag_problems:
        tags = []

    scopes_value = obj.get("observation_scopes")
    scope_problems = [] if tag_problems else observation_scopes_problems(scopes_value, tags)
    problems += [f"observation_scopes: {p}" for p in scope_problems]

    occurred_at = None
    if obj.get("occurred_at") is not None:
        try:
            occurred_at = parse_timestamp(obj["occurred_at"])
        except ValueError as exc:
            problems.append(f"occurred_at {exc}")

    metadata = obj.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        problems.append("metadata must be a JSON object")
        metadata = {}
    else:
        problems += _metadata_problems(metadata)

    if problems:
        raise ValidationError("; ".join(problems), problems)
    return NewMemory(
        id=memory_id,
        text=text,
        tags=tuple(dict.fromkeys(tags)),
        observation_scopes=scopes_value,
        occurred_at=occurred_at,
        metadata=metadata,
        scopes=write_scopes(tags, scopes_value),
    )


def content_id(bank_id: str, line: bytes) -> uuid.UUID:
    """A stable id for a memory given without one, so re-ingesting a file adds nothing."""
    return uuid.uuid5(_CONTENT_NAMESPACE, bank_id.encode().hex() + ":" + line.strip().hex())


_CONTENT_NAMESPACE = uuid.UUID("5b0c7c52-6c1e-4d55-9d59-8f8f0a6b2c11")


def _bad_id() -> uuid.UUID:
    raise ValueError("not a string")


def repeated_id_problems(labelled: Iterable[tuple[str, NewMemory]]) -> list[str]:
    """One problem per memory whose id an earlier one of the same request already has.

    An id names one memory, so a request carrying it twice is ambiguous (which text wins?) and
    is rejected whole rather than half-stored; labels say where each memory came from.
    """
    first_seen: dict[uuid.UUID, str] = {}
    problems: list[str] = []
    for label, memory in labelled:
        earlier = first_seen.setdefault(memory.id, label)
        if earlier != label:
            problems.append(f"{label}: id {memory.id} is already used by {earlier}")
    return problems


def parse_memories(objs: Sequence[object]) -> list[NewMemory]:
    """Validate a batch as a whole: any bad item rejects all, naming each item's index and reason.

    An id given twice in the batch is a problem of the later item.
    """
    parsed: list[tuple[str, NewMemory]] = []
    problems: list[str] = []
    for index, obj in enumerate(objs):
        try:
            parsed.append((f"memories[{index}]", parse_memory(obj)))
        except ValidationError as exc:
            problems += [f"memories[{index}]: {p}" for p in exc.problems]
    problems += repeated_id_problems(parsed)
    if problems:
        raise ValidationError(f"{len(problems)} problem(s) in the memories", problems)
    return [memory for _, memory in parsed]
