"""What an operation's attempts ran into, kept while it waits, and how often it was taken over.

- ``operations.last_error``, ``operations.last_error_at``: the error of the latest attempt that
  ended with one (or the reason it was handed back), and when. ``error`` is cleared when the
  next attempt starts; these stay, so an operation retrying still says why it is retrying.
- ``operations.reclaims``: how many times another claim took the operation over because its
  lease expired (its worker died, or lost the database past the lease). The first few do not
  spend an attempt; past ``queue.MAX_FREE_RECLAIMS`` they do, so an operation that keeps killing
  its worker still ends.

Revision ID: 0008
Revises: 0006
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = """
ALTER TABLE operations ADD COLUMN last_error text;
ALTER TABLE operations ADD COLUMN last_error_at timestamptz;
ALTER TABLE operations ADD COLUMN reclaims integer NOT NULL DEFAULT 0;
UPDATE operations SET last_error = error, last_error_at = COALESCE(finished_at, now())
WHERE error IS NOT NULL AND status IN ('pending', 'failed');
"""

DOWNGRADE = """
ALTER TABLE operations DROP COLUMN reclaims;
ALTER TABLE operations DROP COLUMN last_error_at;
ALTER TABLE operations DROP COLUMN last_error;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
