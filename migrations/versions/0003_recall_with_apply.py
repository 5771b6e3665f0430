"""consolidation_recall and consolidation_apply_pass_then_recall: one round trip per pass.

A pass used to cost two statements on the critical path of its group: the apply of pass k,
then the recall of pass k+1. The engine knows pass k+1 (its scope and facts) when it applies
pass k, so the apply now runs the next pass's recall in the same statement, after the writes,
and returns it. The recall itself becomes a function so that both paths run the same query.

consolidation_apply_pass(jsonb) is kept: a worker still running the previous release uses it
during a rolling upgrade.

Both functions also stop using sequential scans. They only look rows up by key (observations by
id or by bank and scope, sources by observation, the foreign-key checks of their inserts), and
their plans are cached per session when a bank's first passes run: on a new database, or right
after a large ingest, the statistics then still say the tables are empty, and the sequential
scans planned for empty tables were kept while the tables grew (until autovacuum analyzes
them, a minute or more later). The zero-latency benchmark spent ~10 % of Postgres's CPU in
such scans.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = r"""
-- The observations of one scope a pass should see (DESIGN §2, Recall): full-text matches of the
-- batch's facts (any of their lexemes), best first, topped up with the most recently updated.
CREATE FUNCTION consolidation_recall(p_bank text, p_scope text[], p_limit integer, p_text text)
RETURNS TABLE (obs_id uuid, obs_text text, obs_updated_at timestamptz, obs_sources bigint)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $fn$
BEGIN
    RETURN QUERY
    WITH q AS (
        SELECT NULLIF(array_to_string(ARRAY(
                   SELECT quote_literal(l)
                   FROM unnest(tsvector_to_array(to_tsvector('english'::regconfig, p_text))) AS l),
               ' | '), '')::tsquery AS query
    ), ranked AS (
        SELECT o.id, o.text, o.updated_at, ts_rank(o.search, q.query) AS rank
        FROM observations o, q
        WHERE q.query IS NOT NULL AND o.search @@ q.query AND o.bank_id = p_bank
          AND o.scope = p_scope
        ORDER BY rank DESC, o.updated_at DESC
        LIMIT p_limit
    ), recent AS (
        SELECT o.id, o.text, o.updated_at, -1::real AS rank
        FROM observations o
        WHERE o.bank_id = p_bank AND o.scope = p_scope AND o.id NOT IN (SELECT r.id FROM ranked r)
        ORDER BY o.updated_at DESC
        LIMIT p_limit
    )
    SELECT c.id, c.text, c.updated_at,
           (SELECT count(*) FROM observation_sources s WHERE s.observation_id = c.id)
    FROM (SELECT * FROM ranked UNION ALL SELECT * FROM recent) AS c
    ORDER BY c.rank DESC, c.updated_at DESC
    LIMIT p_limit;
END
$fn$;

-- Apply pass k (consolidation_apply_pass: fenced, all or nothing, CN001/CN002), then, in the
-- same transaction and after its writes, recall for the group's next pass when one is given.
CREATE FUNCTION consolidation_apply_pass_then_recall(
    p jsonb, p_scope text[], p_limit integer, p_text text)
RETURNS TABLE (obs_id uuid, obs_text text, obs_updated_at timestamptz, obs_sources bigint)
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM consolidation_apply_pass(p);
    IF p_scope IS NOT NULL AND p_limit > 0 THEN
        RETURN QUERY SELECT * FROM consolidation_recall(p->>'bank_id', p_scope, p_limit, p_text);
    END IF;
END
$fn$;

ALTER FUNCTION consolidation_apply_pass(jsonb) SET enable_seqscan = off;
"""

DOWNGRADE = """
ALTER FUNCTION consolidation_apply_pass(jsonb) RESET enable_seqscan;
DROP FUNCTION consolidation_apply_pass_then_recall(jsonb, text[], integer, text);
DROP FUNCTION consolidation_recall(text, text[], integer, text);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
