"""consolidation_apply_pass(jsonb): apply one pass in one round trip.

A pass used to cost about seven round trips (BEGIN, fence, lock, update, history, inserts,
COMMIT); the benchmark showed the engine spending its time waiting on them. The function runs
the same statements server-side in the caller's single statement (one implicit transaction).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = r"""
-- p: {"operation_id", "worker_id", "attempt", "bank_id", "scope": [tag…],
--     "creates": [{"ids": [id], "text", "memory_ids": […]}],
--     "changes": [{"ids": [keep, merged…], "text", "memory_ids": […]}],   -- update or merge
--     "outcomes": [{"memory_id", "action", "observation_ids": […]}]}
-- Raises SQLSTATE CN001 when the operation is no longer the caller's (fence), CN002 when an
-- observation to change is not in the pass's bank and scope. Either way nothing is written.
CREATE FUNCTION consolidation_apply_pass(p jsonb) RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    v_op      uuid   := (p->>'operation_id')::uuid;
    v_bank    text   := p->>'bank_id';
    v_scope   text[] := ARRAY(SELECT jsonb_array_elements_text(p->'scope'));
    v_change  jsonb;
    v_ids     uuid[];
    v_keep    uuid;
    v_merged  uuid[];
    v_memories uuid[];
    v_old     text;
    v_version integer;
BEGIN
    -- The fence. FOR SHARE makes a reclaim (an UPDATE of this row) wait until we commit, so
    -- the new owner's journal read sees everything we wrote.
    PERFORM 1 FROM operations
    WHERE id = v_op AND worker_id = p->>'worker_id' AND attempt = (p->>'attempt')::integer
      AND status = 'running'
    FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'operation % attempt % is no longer owned by %',
            v_op, p->>'attempt', p->>'worker_id' USING ERRCODE = 'CN001';
    END IF;

    FOR v_change IN SELECT * FROM jsonb_array_elements(p->'changes') LOOP
        v_ids := ARRAY(SELECT jsonb_array_elements_text(v_change->'ids'))::uuid[];
        v_keep := v_ids[1];
        v_merged := v_ids[2:];
        v_memories := ARRAY(SELECT jsonb_array_elements_text(v_change->'memory_ids'))::uuid[];
        PERFORM 1 FROM observations
        WHERE id = ANY(v_ids) AND bank_id = v_bank AND scope = v_scope
        FOR UPDATE;
        IF (SELECT count(*) FROM observations
            WHERE id = ANY(v_ids) AND bank_id = v_bank AND scope = v_scope)
           <> cardinality(v_ids) THEN
            RAISE EXCEPTION 'observation(s) % not in bank % scope %', v_ids, v_bank, v_scope
                USING ERRCODE = 'CN002';
        END IF;
        SELECT text INTO v_old FROM observations WHERE id = v_keep;
        UPDATE observations
        SET text = v_change->>'text', updated_at = now(), version = version + 1
        WHERE id = v_keep
        RETURNING version INTO v_version;
        INSERT INTO observation_history
            (observation_id, bank_id, scope, operation_id, action, version, previous_text,
             new_text, merged_into, memory_ids)
        VALUES (v_keep, v_bank, v_scope, v_op,
                CASE WHEN cardinality(v_merged) > 0 THEN 'merged' ELSE 'updated' END,
                v_version, v_old, v_change->>'text', NULL, v_memories);
        IF cardinality(v_merged) > 0 THEN
            INSERT INTO observation_sources (observation_id, memory_id, operation_id, created_at)
            SELECT v_keep, s.memory_id, s.operation_id, s.created_at
            FROM observation_sources s WHERE s.observation_id = ANY(v_merged)
            ON CONFLICT DO NOTHING;
            INSERT INTO observation_history
                (observation_id, bank_id, scope, operation_id, action, version, previous_text,
                 new_text, merged_into, memory_ids)
            SELECT o.id, v_bank, v_scope, v_op, 'merged_away', o.version, o.text, NULL, v_keep,
                   v_memories
            FROM observations o WHERE o.id = ANY(v_merged);
            DELETE FROM observations WHERE id = ANY(v_merged);
        END IF;
    END LOOP;

    INSERT INTO observations (id, bank_id, scope, text)
    SELECT (c->'ids'->>0)::uuid, v_bank, v_scope, c->>'text'
    FROM jsonb_array_elements(p->'creates') AS c;

    INSERT INTO observation_sources (observation_id, memory_id, operation_id)
    SELECT (w->'ids'->>0)::uuid, m::uuid, v_op
    FROM jsonb_array_elements((p->'creates') || (p->'changes')) AS w,
         jsonb_array_elements_text(w->'memory_ids') AS m
    ON CONFLICT DO NOTHING;

    INSERT INTO consolidation_outcomes (memory_id, scope, operation_id, action, observation_ids)
    SELECT (o->>'memory_id')::uuid, v_scope, v_op, o->>'action',
           ARRAY(SELECT jsonb_array_elements_text(o->'observation_ids'))::uuid[]
    FROM jsonb_array_elements(p->'outcomes') AS o;
END
$fn$;
"""

DOWNGRADE = "DROP FUNCTION consolidation_apply_pass(jsonb);"


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
