"""Per-bank token budgets: what each bank's consolidations used, and a bank's own budget.

- ``bank_token_usage``: one row per closed wave with the prompt and completion tokens its passes
  used, and when. A budget counts the rows of the last 24 hours; older rows are pruned as new
  ones are written (they count for nothing).
- ``banks.token_budget``: the bank's own tokens per rolling 24 hours (``PUT
  /v1/banks/{bank_id}/token-budget``); NULL follows ``CONSOLIDATION_BANK_TOKEN_BUDGET``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = """
ALTER TABLE banks ADD COLUMN token_budget bigint CHECK (token_budget >= 0);
CREATE TABLE bank_token_usage (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    bank_id text NOT NULL REFERENCES banks (id) ON DELETE CASCADE,
    operation_id uuid,
    tokens bigint NOT NULL CHECK (tokens > 0),
    used_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX bank_token_usage_window_idx ON bank_token_usage (bank_id, used_at);
"""

DOWNGRADE = """
DROP TABLE bank_token_usage;
ALTER TABLE banks DROP COLUMN token_budget;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
