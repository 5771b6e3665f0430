"""Functions from consolidation/sql/, one fence, one form of a scope, failure reasons.

- The plpgsql the engine calls now lives in ``consolidation/sql/*.sql`` under versioned names
  (``consolidation_apply_pass_v1``, ``consolidation_recall_v1``) and is created from there. The
  fence has one definition, ``consolidation_holds_lease_v1``, called by every fenced write. The
  unversioned functions of 0002/0003 are dropped.
- A scope has one database form, ``text[]``: a memory's write scopes move from ``scope_keys``
  (tags joined by U+001F in one text[]) to one ``memory_scopes`` row per scope, like
  ``observations.scope`` and ``consolidation_outcomes.scope``. Existing rows are moved.
- ``memories.consolidation_failed_reason`` keeps why a memory was marked failed.
- ``operations.interruptions`` counts attempts handed back because the database was unreachable
  (they do not spend an attempt; this bounds them).

Not for a rolling upgrade: replicas of the previous release read ``scope_keys``; stop them before
the first replica of this release migrates.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

import importlib
from collections.abc import Sequence

from alembic import op

from consolidation.sql import read

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTIONS = (
    "consolidation_holds_lease_v1",
    "consolidation_recall_v1",
    "consolidation_apply_pass_v1",
)

UPGRADE = r"""
DROP FUNCTION consolidation_apply_pass_then_recall(jsonb, text[], integer, text);
DROP FUNCTION consolidation_recall(text, text[], integer, text);
DROP FUNCTION consolidation_apply_pass(jsonb);

CREATE TABLE memory_scopes (
    memory_id  uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    scope      text[] NOT NULL,
    PRIMARY KEY (memory_id, scope)
);
INSERT INTO memory_scopes (memory_id, scope)
SELECT m.id, string_to_array(k, E'\x1f')
FROM memories m, unnest(m.scope_keys) AS k
ON CONFLICT DO NOTHING;
ALTER TABLE memories DROP COLUMN scope_keys;

ALTER TABLE memories ADD COLUMN consolidation_failed_reason text;
ALTER TABLE operations ADD COLUMN interruptions integer NOT NULL DEFAULT 0;
"""

DOWNGRADE = r"""
ALTER TABLE operations DROP COLUMN interruptions;
ALTER TABLE memories DROP COLUMN consolidation_failed_reason;
ALTER TABLE memories ADD COLUMN scope_keys text[];
UPDATE memories m
SET scope_keys = ARRAY(SELECT array_to_string(s.scope, E'\x1f') FROM memory_scopes s
                       WHERE s.memory_id = m.id ORDER BY s.scope);
ALTER TABLE memories ALTER COLUMN scope_keys SET NOT NULL;
DROP TABLE memory_scopes;
DROP FUNCTION consolidation_apply_pass_v1(jsonb, text[], integer, text);
DROP FUNCTION consolidation_recall_v1(text, text[], integer, text);
DROP FUNCTION consolidation_holds_lease_v1(uuid, text, integer);
"""


def upgrade() -> None:
    op.execute(UPGRADE)
    for name in FUNCTIONS:
        op.execute(read(name))


def downgrade() -> None:
    op.execute(DOWNGRADE)
    # The functions of 0002 and 0003, as those revisions create them.
    for module in ("0002_apply_pass_function", "0003_recall_with_apply"):
        revision_module = importlib.import_module(f"consolidation.migrations.versions.{module}")
        revision_module.upgrade()
