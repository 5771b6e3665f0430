"""Query parameters of the API that need more than a type: a scope, and opaque page cursors."""

from __future__ import annotations

import base64
import binascii
import re
import uuid

from consolidation.api_errors import ApiError
from consolidation.api_models import TAG_PATTERN
from consolidation.scopes import MAX_TAG_CHARS, MAX_TAGS, Scope, normalize_scope

_TAG_RE = re.compile(TAG_PATTERN)


def scope_param(value: str | None) -> Scope | None:
    """``None`` (absent) → every scope; ``""`` → the shared scope; ``a,b`` → that scope."""
    if value is None:
        return None
    if value == "":
        return ()
    tags = value.split(",")
    problems = [
        f"scope tag {tag[:20]!r} must be 1 to {MAX_TAG_CHARS} characters, not blank, "
        "without control characters"
        for tag in tags
        if len(tag) > MAX_TAG_CHARS or not _TAG_RE.fullmatch(tag)
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
