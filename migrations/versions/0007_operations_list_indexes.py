"""Indexes for listing operations newest first (GET /v1/operations and the dashboard).

Keyset pagination on (created_at, id), unfiltered or by status; a bank's operations already
have operations_bank_idx. Built without CONCURRENTLY like the rest of the schema: on a table of
a million operations the build holds writes to it for about a second.

Revision ID: 0007
Revises: 0005
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = """
CREATE INDEX operations_created_idx ON operations (created_at DESC, id DESC);
CREATE INDEX operations_status_created_idx ON operations (status, created_at DESC, id DESC);
"""

DOWNGRADE = """
DROP INDEX operations_status_created_idx;
DROP INDEX operations_created_idx;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
