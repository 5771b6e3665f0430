"""Parameters of the API that need more than a type: a bank id, a scope, opaque page cursors."""

from __future__ import annotations

import base64
import binascii
import struct
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from consolidation import store
from consolidation.api.errors import ApiError
from consolidation.memories import MAX_BANK_ID_CHARS, bank_id_problems
from consolidation.scopes import MAX_TAGS, Scope, normalize_scope, tag_problem

# The longest cursor: a bank id of MAX_BANK_ID_CHARS four-byte characters.
MAX_CURSOR_CHARS = (MAX_BANK_ID_CHARS * 4 * 4 + 2) // 3


def check_bank_id(bank_id: str) -> None:
    """Raise a 422 unless ``bank_id`` is usable as a bank id (memories.bank_id_problems)."""
    problems = bank_id_problems(bank_id)
    if problems:
        raise ApiError(422, "invalid_bank_id", problems[0], problems)


async def require_bank(pool: asyncpg.Pool, bank_id: str) -> None:
    """Raise a 422 for an unusable bank id, a 404 for a bank that does not exist."""
    check_bank_id(bank_id)
    if not await store.bank_exists(pool, bank_id):
        raise ApiError(404, "bank_not_found", f"bank {bank_id!r} does not exist")


def scope_param(value: str | None) -> Scope | None:
    """``None`` (absent) → every scope; ``""`` → the shared scope; ``a,b`` → that scope."""
    if value is None:
        return None
    if value == "":
        return ()
    tags = value.split(",")
    problems = [
        f"scope tag {tag[:20]!r} {problem}"
        for tag in tags
        if (problem := tag_problem(tag)) is not None
    ]
    scope = normalize_scope(tags)
    if len(scope) > MAX_TAGS:
        problems.append(f"a scope has at most {MAX_TAGS} tags, got {len(scope)}")
    if problems:
        raise ApiError(422, "invalid_request", "invalid scope parameter", problems)
    return scope


# Cursors are the previous page's last sort key in unpadded urlsafe base64; only the canonical
# spelling is accepted, so a cursor either names a position exactly or is refused with a 400.

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_INVALID = "cursor is not one this API returned"


def encode_cursor(last_id: uuid.UUID) -> str:
    """The cursor after an observation (pages ordered by id)."""
    return _encode(last_id.bytes)


def decode_cursor(cursor: str) -> uuid.UUID:
    raw = _decode(cursor)
    if len(raw) != 16:
        raise ApiError(400, "invalid_cursor", _INVALID)
    return uuid.UUID(bytes=raw)


def encode_time_cursor(created_at: datetime, last_id: uuid.UUID) -> str:
    """The cursor after a row of a page ordered by (a timestamp, an id), newest first."""
    micros = (created_at - _EPOCH) // timedelta(microseconds=1)
    return _encode(struct.pack(">q", micros) + last_id.bytes)


def decode_time_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    raw = _decode(cursor)
    if len(raw) != 24:
        raise ApiError(400, "invalid_cursor", _INVALID)
    (micros,) = struct.unpack(">q", raw[:8])
    try:
        created_at = _EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        raise ApiError(400, "invalid_cursor", _INVALID) from None
    return created_at, uuid.UUID(bytes=raw[8:])


def encode_bank_cursor(bank_id: str) -> str:
    """The cursor after a bank (pages ordered by bank id)."""
    return _encode(bank_id.encode())


def decode_bank_cursor(cursor: str) -> str:
    try:
        return _decode(cursor).decode()
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_cursor", _INVALID) from None


def _encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _decode(cursor: str) -> bytes:
    invalid = ApiError(400, "invalid_cursor", _INVALID)
    if not cursor or len(cursor) > MAX_CURSOR_CHARS or not cursor.isascii():
        raise invalid
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise invalid from None
    if _encode(raw) != cursor:
        raise invalid
    return raw
