"""Query parameters of the API that need more than a type: a scope, and opaque page cursors."""

from __future__ import annotations

import base64
import binascii
import uuid

from consolidation.api_errors import ApiError
from consolidation.scopes import MAX_TAGS, Scope, normalize_scope, tag_problem


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


def encode_cursor(last_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(last_id.bytes).rstrip(b"=").decode()


def decode_cursor(cursor: str) -> uuid.UUID:
    invalid = ApiError(400, "invalid_cursor", "cursor is not one this API returned")
    if len(cursor) != 22 or not cursor.isascii():
        raise invalid
    try:
        raw = base64.b64decode(cursor + "==", altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise invalid from None
    if len(raw) != 16:
        raise invalid
    last_id = uuid.UUID(bytes=raw)
    if encode_cursor(last_id) != cursor:  # only the canonical spelling is accepted
        raise invalid
    return last_id
