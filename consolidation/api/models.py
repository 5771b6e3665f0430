"""Request and response models of the HTTP API: what FastAPI validates and what ``/docs`` shows.

Memories themselves are checked by ``memories.parse_memories`` (one set of rules for the API and
``consolidation ingest``); their model here documents them only.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Path, Query
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
)

from consolidation.api.errors import phrase
from consolidation.memories import MAX_BANK_ID_CHARS, MAX_TEXT_CHARS
from consolidation.scopes import MAX_TAG_CHARS, MAX_TAGS, tag_problem
from consolidation.store import BankCounts

MAX_MEMORIES_PER_REQUEST = 1000
MAX_SCOPES_PER_REQUEST = 100
MAX_PRIORITY = 1000
MAX_PAGE = 1000
MAX_TOKEN_BUDGET = 10**15  # far above any real budget, well inside the column's bigint

# Tags are checked by scopes.tag_problem, the one rule for the API, the CLI and ingestion; the
# pattern only documents that rule in /openapi.json (tests/unit/test_api_models.py keeps them in
# agreement). Bank ids follow memories.bank_id_problems, which allows U+007F.
TAG_PATTERN = r"^[^\x00-\x1f\x7f]*[^\x00-\x1f\x7f\s][^\x00-\x1f\x7f]*$"
BANK_ID_PATTERN = r"^[^\x00-\x1f]*[^\x00-\x1f\s][^\x00-\x1f]*$"
# Documentation only (the routes answer 422 / 400 themselves): comma-separated tags, and the
# spelling of a 16-byte id in unpadded urlsafe base64 (the last character carries 2 zero bits).
_LISTED_TAG = r"[^\x00-\x1f\x7f,]*[^\x00-\x1f\x7f,\s][^\x00-\x1f\x7f,]*"
SCOPE_PARAM_PATTERN = rf"^(?:{_LISTED_TAG}(?:,{_LISTED_TAG})*)?$"
CURSOR_PATTERN = r"^[A-Za-z0-9_-]{21}[AQgw]$"
TIME_CURSOR_PATTERN = r"^[A-Za-z0-9_-]{32}$"
BANK_CURSOR_PATTERN = r"^[A-Za-z0-9_-]+$"


def _checked_tag(value: str) -> str:
    problem = tag_problem(value)
    if problem is not None:
        raise ValueError(f"tag {problem}")
    return value


Tag = Annotated[
    str,
    AfterValidator(_checked_tag),
    WithJsonSchema(
        {"type": "string", "minLength": 1, "maxLength": MAX_TAG_CHARS, "pattern": TAG_PATTERN}
    ),
]
BankId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_BANK_ID_CHARS,
        pattern=BANK_ID_PATTERN,
        description="The memory bank (created by its first ingestion).",
    ),
]
OperationStatus = Literal["pending", "running", "completed", "failed", "cancelled"]
PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="At most this many per page.")]


def cursor_query(pattern: str) -> Any:
    """The ``?cursor=`` of a list route, documented with the spelling its cursors have."""
    return Query(
        description="The previous page's next_cursor (opaque).",
        json_schema_extra={"pattern": pattern},
    )


class MemoryIn(BaseModel):
    """One memory (documentation only: ``memories.parse_memories`` does the real checks)."""

    model_config = ConfigDict(extra="forbid")

    id: uuid.UUID | None = Field(
        default=None, description="Idempotency key; a random UUID when absent."
    )
    text: Annotated[
        str,
        StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS, pattern=r"^[^\x00]*\S[^\x00]*$"),
    ]
    tags: Annotated[list[Tag], Field(max_length=MAX_TAGS)] | None = None
    observation_scopes: (
        Literal["combined", "per_tag", "all_combinations", "shared"]
        | Annotated[list[list[Tag]], Field(min_length=1)]
        | None
    ) = Field(default=None, description="Where observations of this memory are written.")
    occurred_at: datetime | None = Field(default=None, description="Event time (ISO-8601).")
    metadata: dict[str, Any] | None = None


MemoryItem = Annotated[Any, WithJsonSchema(MemoryIn.model_json_schema())]


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    memories: Annotated[list[MemoryItem], Field(min_length=1, max_length=MAX_MEMORIES_PER_REQUEST)]


class IngestResponse(BaseModel):
    ids: list[uuid.UUID] = Field(description="The memories' ids, in input order.")
    operation_id: uuid.UUID | None = Field(
        description="The consolidation this ingestion enqueued or joined (an already pending "
        "one); null when nothing was enqueued (CONSOLIDATION_AUTO_CONSOLIDATE=false)."
    )


class ConsolidationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    scopes: (
        Annotated[
            list[Annotated[list[Tag], Field(max_length=MAX_TAGS)]],
            Field(min_length=1, max_length=MAX_SCOPES_PER_REQUEST),
        ]
        | None
    ) = Field(default=None, description="Only these scopes ([] is the shared one); all if absent.")
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0


class ConsolidationResponse(BaseModel):
    operation_id: uuid.UUID
    status: OperationStatus
    deduplicated: bool = Field(description="True when an already pending operation was reused.")


class OperationResponse(BaseModel):
    operation_id: uuid.UUID
    bank_id: str
    kind: Literal["consolidate", "forget"] = Field(
        description="consolidate (pending memories into observations) or forget (memories and "
        "what was derived from them)."
    )
    status: OperationStatus
    attempt: int
    progress: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    last_error: str | None = Field(
        description="The latest attempt's error (or why it was handed back); kept while the "
        "next attempt waits and runs."
    )
    last_error_at: datetime | None = Field(description="When last_error happened.")
    run_after: datetime = Field(description="When a pending operation may start its next attempt.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class OperationsPage(BaseModel):
    operations: list[OperationResponse] = Field(description="Newest first.")
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at end.")


class CancelResponse(BaseModel):
    operation_id: uuid.UUID
    status: OperationStatus


class ObservationOut(BaseModel):
    id: uuid.UUID
    scope: list[str]
    text: str
    source_memory_ids: list[uuid.UUID]
    updated_at: datetime


class ObservationsPage(BaseModel):
    observations: list[ObservationOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at end.")


class StatsResponse(BaseModel):
    pending: int
    consolidated: int
    failed: int
    observations: int
    oldest_pending_age_s: float | None


class BankOut(StatsResponse):
    bank_id: str
    created_at: datetime


class BanksPage(BaseModel):
    banks: list[BankOut] = Field(description="Ordered by bank id.")
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at end.")


class TokenBudgetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tokens_per_24h: Annotated[int, Field(ge=0, le=MAX_TOKEN_BUDGET)] | None = Field(
        description="Prompt and completion tokens the bank may use in any rolling 24 hours "
        "(0 stops it); null follows CONSOLIDATION_BANK_TOKEN_BUDGET again."
    )


class TokenBudgetResponse(BaseModel):
    bank_id: str
    tokens_per_24h: int | None = Field(description="The budget that applies; null: no limit.")
    source: Literal["bank", "setting", "none"] = Field(
        description="bank (set through this route), setting (CONSOLIDATION_BANK_TOKEN_BUDGET) or "
        "none (no limit)."
    )
    used_24h: int = Field(description="Tokens the bank's consolidations used in the last 24 h.")
    resumes_at: datetime | None = Field(
        description="While the budget is used: when the window frees enough for the bank's "
        "operations to resume (null for a budget of 0, or when it is not used up)."
    )


class RecoverResponse(BaseModel):
    recovered: int


class StatusResponse(BaseModel):
    status: str


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: list[str] = Field(default=[], description="Every problem found, when several.")


class ErrorBody(BaseModel):
    error: ErrorDetail


class ForgetResponse(BaseModel):
    memory_id: uuid.UUID
    operation_id: uuid.UUID = Field(
        description="The forget operation that deletes the memory and what was derived from it."
    )


class BankDeleted(BaseModel):
    bank_id: str
    deleted: BankCounts


class ConfirmationError(ErrorDetail):
    counts: BankCounts = Field(description="What the deletion would remove (a dry run).")


class ConfirmationErrorBody(BaseModel):
    error: ConfirmationError


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that can answer these statuses with the error shape."""
    return {s: {"model": ErrorBody, "description": phrase(s)} for s in statuses}


# Every /v1 route can answer these whatever its own errors.
V1_ERRORS = (400, 401, 404, 405, 413, 415, 422, 500, 503)
