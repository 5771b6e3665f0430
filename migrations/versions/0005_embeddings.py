"""Optional embeddings: vector columns where pgvector is, and the functions of hybrid recall.

The schema depends on the server (docs/architecture.md, Embeddings):
- pgvector installed or installable (the embedded Postgres, the pgvector/pgvector images, most
  managed services): the extension is created if this role may, and ``observations`` gains
  ``embedding vector`` (any dimension) and ``embedding_version integer`` (the observation's
  version its vector was computed for; a vector of an older version is ignored);
- no pgvector: no column, and nothing else differs. Without ``CONSOLIDATION_EMBEDDINGS_BASE_URL``
  the service never needs one.
The same idempotent SQL (consolidation/sql/embeddings_schema.sql) runs again at every start-up
with embeddings configured, so a server that gains pgvector later (``CREATE EXTENSION`` by an
operator, or the package installed) gets the columns then; with still no pgvector, start-up
stops with one line saying so.

The new functions are plpgsql, which resolves ``vector`` only when called, so they are created
on every server and called only when embeddings are on:
- consolidation_recall_hybrid_v1: full text and cosine, fused (the recall of a pass);
- consolidation_apply_pass_v2: consolidation_apply_pass_v1 that also stores the vectors of the
  observations it writes and returns the next pass's hybrid recall.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

from consolidation.sql import read

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTIONS = ("consolidation_recall_hybrid_v1", "consolidation_apply_pass_v2")

DOWNGRADE = """
DROP FUNCTION consolidation_apply_pass_v2(jsonb, text[], integer, text[], text[]);
DROP FUNCTION consolidation_recall_hybrid_v1(
    text, text[], integer, text[], text[], text, integer, float8);
ALTER TABLE observations DROP COLUMN IF EXISTS embedding, DROP COLUMN IF EXISTS embedding_version;
"""


def upgrade() -> None:
    op.execute(read("embeddings_schema"))
    for name in FUNCTIONS:
        op.execute(read(name))


def downgrade() -> None:
    # The extension stays: other schemas of the database may use it.
    op.execute(DOWNGRADE)
