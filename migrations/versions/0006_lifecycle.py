"""Knowledge lifecycle: forgetting memories, forget operations, the fairness slice's resume.

- ``memories.forgotten_at``: a forget was asked for this memory. Waves, counts and stats leave it
  out at once; the forget operation deletes it (and what was derived from it) later.
- ``forgotten_memories``: one tombstone per memory id asked to be forgotten — which operation does
  it and when it completed — so a repeated ``DELETE`` answers the same operation. It holds no
  content, only ids.
- ``operations.kind``: ``consolidate`` or ``forget``. The unscoped-pending index now covers
  ``consolidate`` only; a second index allows at most one pending ``forget`` per bank (requests
  join it). One running operation per bank, whatever its kind, as before.
- ``observation_history_merged_into_idx``: the lineage of an observation (everything merged into
  it) is followed through ``merged_into``. ``observation_history_bank_idx``: deleting a bank
  cascades to its history rows through ``bank_id``, which had no index (a scan of the table).
- Functions from ``consolidation/sql``: ``consolidation_lineage_v1``,
  ``consolidation_rederive_v1``, ``consolidation_forget_v1``.

Not for a rolling upgrade: the previous release's submit names the old unscoped-pending index
predicate; stop its replicas before the first replica of this release migrates.

Revision ID: 0006
Revises: 0007
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import op

from consolidation.sql import read

revision: str = "0006"
# After 0007 although numbered before it: 0007 (the operations list) reached main first, and a
# database already at 0007 must still get this revision.
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTIONS = (
    "consolidation_lineage_v1",
    "consolidation_rederive_v1",
    "consolidation_forget_v1",
)

UPGRADE = r"""
ALTER TABLE memories ADD COLUMN forgotten_at timestamptz;
CREATE INDEX memories_forgotten_idx ON memories (bank_id) WHERE forgotten_at IS NOT NULL;

CREATE TABLE forgotten_memories (
    memory_id     uuid PRIMARY KEY,
    bank_id       text NOT NULL REFERENCES banks (id) ON DELETE CASCADE,
    operation_id  uuid NOT NULL,
    requested_at  timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz
);
CREATE INDEX forgotten_memories_bank_idx ON forgotten_memories (bank_id);

ALTER TABLE operations ADD COLUMN kind text NOT NULL DEFAULT 'consolidate'
    CHECK (kind IN ('consolidate', 'forget'));
DROP INDEX operations_one_unscoped_pending_per_bank;
CREATE UNIQUE INDEX operations_one_unscoped_pending_per_bank ON operations (bank_id)
    WHERE status = 'pending' AND scope_filter IS NULL AND kind = 'consolidate';
CREATE UNIQUE INDEX operations_one_pending_forget_per_bank ON operations (bank_id)
    WHERE status = 'pending' AND kind = 'forget';

CREATE INDEX observation_history_merged_into_idx ON observation_history (merged_into)
    WHERE merged_into IS NOT NULL;
CREATE INDEX observation_history_bank_idx ON observation_history (bank_id);
"""

DOWNGRADE = r"""
DROP FUNCTION consolidation_forget_v1(jsonb);
DROP FUNCTION consolidation_rederive_v1(jsonb);
DROP FUNCTION consolidation_lineage_v1(uuid[]);
DROP INDEX observation_history_bank_idx;
DROP INDEX observation_history_merged_into_idx;
DELETE FROM operations WHERE kind = 'forget';
DROP INDEX operations_one_pending_forget_per_bank;
DROP INDEX operations_one_unscoped_pending_per_bank;
CREATE UNIQUE INDEX operations_one_unscoped_pending_per_bank ON operations (bank_id)
    WHERE status = 'pending' AND scope_filter IS NULL;
ALTER TABLE operations DROP COLUMN kind;
DROP TABLE forgotten_memories;
DROP INDEX memories_forgotten_idx;
ALTER TABLE memories DROP COLUMN forgotten_at;
"""


def upgrade() -> None:
    op.execute(UPGRADE)
    for name in FUNCTIONS:
        op.execute(read(name))


def downgrade() -> None:
    op.execute(DOWNGRADE)
