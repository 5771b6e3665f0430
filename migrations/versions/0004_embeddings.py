"""Optional embeddings: vector columns where pgvector is, and the hybrid recall function.

The schema depends on the server (docs/architecture.md, Embeddings):
- pgvector installed or installable (the embedded Postgres, the pgvector/pgvector images, most
  managed services): the extension is created if this role may, and ``observations`` gains
  ``embedding vector`` and ``embedding_version integer``;
- no pgvector: no column. Nothing else changes, and without
  ``CONSOLIDATION_EMBEDDINGS_BASE_URL`` the service never needs one.
The same idempotent SQL (consolidation/sql/embeddings_schema.sql) runs again at start-up when
embeddings are configured, so a server that gains pgvector later gets the columns then; if it
still has none, start-up stops with one line saying so.

consolidation_recall_hybrid_v1 is plpgsql, which resolves ``vector`` only when called: it is
created on every server and called only when embeddings are on.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from collections.abc import Sequence
from importlib import resources

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _sql(name: str) -> str:
    return resources.files("consolidation").joinpath("sql", name).read_text()


def upgrade() -> None:
    # The same file consolidation.embeddings.require_vector_storage runs at start-up.
    op.execute(_sql("embeddings_schema.sql"))
    op.execute(_sql("consolidation_recall_hybrid_v1.sql"))


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION consolidation_recall_hybrid_v1(text, text[], integer, text[], text[], integer);"
        " ALTER TABLE observations DROP COLUMN IF EXISTS embedding,"
        " DROP COLUMN IF EXISTS embedding_version;"
    )
