"""Initial schema: banks, memories, observations and provenance, the journal, operations.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = r"""
CREATE TABLE banks (
    id          text PRIMARY KEY,
    mission     text,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE memories (
    id                      uuid PRIMARY KEY,
    bank_id                 text NOT NULL REFERENCES banks (id) ON DELETE CASCADE,
    text                    text NOT NULL,
    tags                    text[] NOT NULL DEFAULT '{}',
    observation_scopes      jsonb,
    -- The write scopes resolved at ingestion, each encoded as its tags joined by U+001F
    -- ('' is the shared scope), so scope filters are an array overlap on an index.
    scope_keys              text[] NOT NULL,
    occurred_at             timestamptz,
    -- clock_timestamp(): rows of one insert keep their order instead of sharing now().
    created_at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    consolidation_order     timestamptz GENERATED ALWAYS AS (COALESCE(occurred_at, created_at)) STORED,
    consolidated_at         timestamptz,
    consolidation_failed_at timestamptz,
    metadata                jsonb NOT NULL DEFAULT '{}'::jsonb
);
-- Waves read the pending memories of one bank in consolidation order.
CREATE INDEX memories_pending_idx ON memories (bank_id, consolidation_order, id)
    WHERE consolidated_at IS NULL AND consolidation_failed_at IS NULL;
CREATE INDEX memories_bank_idx ON memories (bank_id);
CREATE INDEX memories_failed_idx ON memories (bank_id) WHERE consolidation_failed_at IS NOT NULL;

CREATE TABLE observations (
    id          uuid PRIMARY KEY,
    bank_id     text NOT NULL REFERENCES banks (id) ON DELETE CASCADE,
    scope       text[] NOT NULL,
    text        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    version     integer NOT NULL DEFAULT 1,
    search      tsvector GENERATED ALWAYS AS (to_tsvector('english'::regconfig, text)) STORED
);
CREATE INDEX observations_scope_idx ON observations (bank_id, scope, updated_at DESC);
CREATE INDEX observations_search_idx ON observations USING gin (search);

CREATE TABLE observation_sources (
    observation_id  uuid NOT NULL REFERENCES observations (id) ON DELETE CASCADE,
    memory_id       uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    operation_id    uuid,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (observation_id, memory_id)
);
CREATE INDEX observation_sources_memory_idx ON observation_sources (memory_id);

-- Kept after an observation is merged away, so no text is ever lost.
CREATE TABLE observation_history (
    id              bigserial PRIMARY KEY,
    observation_id  uuid NOT NULL,
    bank_id         text NOT NULL REFERENCES banks (id) ON DELETE CASCADE,
    scope           text[] NOT NULL,
    operation_id    uuid,
    action          text NOT NULL CHECK (action IN ('updated', 'merged', 'merged_away')),
    version         integer NOT NULL,
    previous_text   text NOT NULL,
    new_text        text,
    merged_into     uuid,
    memory_ids      uuid[] NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX observation_history_observation_idx ON observation_history (observation_id, id);

-- The journal: one row per (memory, scope) whose pass was applied. Its primary key makes a
-- second application of the same pair impossible, whatever a worker believes.
CREATE TABLE consolidation_outcomes (
    memory_id        uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    scope            text[] NOT NULL,
    operation_id     uuid NOT NULL,
    action           text NOT NULL
        CHECK (action IN ('created', 'updated', 'merged', 'multiple', 'skipped')),
    observation_ids  uuid[] NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (memory_id, scope)
);
CREATE INDEX consolidation_outcomes_operation_idx ON consolidation_outcomes (operation_id);

CREATE TABLE operations (
    id                   uuid PRIMARY KEY,
    bank_id              text NOT NULL REFERENCES banks (id) ON DELETE CASCADE,
    status               text NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'running', 'completed', 'failed', 'cancelled')),
    scope_filter         jsonb,
    priority             integer NOT NULL DEFAULT 0,
    attempt              integer NOT NULL DEFAULT 0,
    max_attempts         integer NOT NULL DEFAULT 5,
    worker_id            text,
    lease_expires_at     timestamptz,
    run_after            timestamptz NOT NULL DEFAULT now(),
    cancel_requested_at  timestamptz,
    progress             jsonb NOT NULL DEFAULT '{}'::jsonb,
    result               jsonb,
    error                text,
    created_at           timestamptz NOT NULL DEFAULT now(),
    started_at           timestamptz,
    finished_at          timestamptz
);
-- The database, not only the claim query, guarantees one running operation per bank.
CREATE UNIQUE INDEX operations_one_running_per_bank ON operations (bank_id)
    WHERE status = 'running';
-- At most one unscoped pending operation per bank: submits de-duplicate on it.
CREATE UNIQUE INDEX operations_one_unscoped_pending_per_bank ON operations (bank_id)
    WHERE status = 'pending' AND scope_filter IS NULL;
CREATE INDEX operations_claimable_idx ON operations (priority DESC, run_after, created_at)
    WHERE status = 'pending';
CREATE INDEX operations_lease_idx ON operations (lease_expires_at) WHERE status = 'running';
CREATE INDEX operations_bank_idx ON operations (bank_id, created_at DESC);
"""

DOWNGRADE = """
DROP TABLE operations;
DROP TABLE consolidation_outcomes;
DROP TABLE observation_history;
DROP TABLE observation_sources;
DROP TABLE observations;
DROP TABLE memories;
DROP TABLE banks;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
