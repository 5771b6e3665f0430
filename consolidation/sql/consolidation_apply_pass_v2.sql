-- consolidation_apply_pass_v1 with embeddings (migration 0005): each observation it creates or
-- updates also stores the vector of its new text, and the recall of the group's next pass is
-- the hybrid one. Only called when embeddings are configured (the column exists then).
--
-- p: as for v1, each item of "creates" and "changes" with "embedding": the vector of its text in
--    pgvector's text form ('[x,y,…]'), or null when the endpoint refused that text (the
--    observation then has no vector until its next update).
-- p_texts, p_vectors: the next pass's facts and their vectors (consolidation_recall_hybrid_v1).
-- Raises SQLSTATE CN001 when the operation is no longer the caller's (the fence), CN002 when an
-- observation to change is not in the pass's bank and scope. Either way nothing is written.
CREATE FUNCTION consolidation_apply_pass_v2(
    p jsonb, p_scope text[], p_limit integer, p_texts text[], p_vectors text[])
RETURNS TABLE (obs_id uuid, obs_text text, obs_updated_at timestamptz, obs_sources bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
DECLARE
    v_op       uuid   := (p->>'operation_id')::uuid;
    v_bank     text   := p->>'bank_id';
    v_scope    text[] := ARRAY(SELECT jsonb_array_elements_text(p->'scope'));
    v_change   jsonb;
    v_ids      uuid[];
    v_keep     uuid;
    v_merged   uuid[];
    v_memories uuid[];
    v_old      text;
    v_version  integer;
BEGIN
    IF NOT consolidation_holds_lease_v1(v_op, p->>'worker_id', (p->>'attempt')::integer) THEN
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
        SET text = v_change->>'text', updated_at = now(), version = version + 1,
            embedding = (v_change->>'embedding')::vector,
            embedding_version = CASE WHEN v_change->>'embedding' IS NOT NULL THEN version + 1 END
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

    INSERT INTO observations (id, bank_id, scope, text, embedding, embedding_version)
    SELECT (c->'ids'->>0)::uuid, v_bank, v_scope, c->>'text', (c->>'embedding')::vector,
           CASE WHEN c->>'embedding' IS NOT NULL THEN 1 END
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

    IF p_scope IS NOT NULL AND p_limit > 0 THEN
        RETURN QUERY SELECT * FROM consolidation_recall_hybrid_v1(
            v_bank, p_scope, p_limit, p_texts, p_vectors);
    END IF;
END
$fn$;
