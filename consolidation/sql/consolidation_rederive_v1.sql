-- Replace one observation that cites a memory being forgotten with what its remaining sources
-- say (the forget operation asked the LLM with those sources alone, DESIGN §3, and folded the
-- answers into ``creates``), in ONE transaction: the new observations and their sources; the
-- journal rows of the remaining sources in the observation's scope name the new observations
-- instead of the old lineage ('skipped' when they are cited by none); the history of the old
-- observation's lineage and the observation itself are deleted. An observation that is already
-- gone (an earlier attempt committed this) is left alone, so a redo changes nothing.
--
-- p: {"operation_id", "worker_id", "attempt", "bank_id", "observation_id", "embeddings",
--     "forgotten": [memory id…],
--     "creates": [{"id", "text", "memory_ids": [memory id…], "embedding": vector text or null}]}
-- ("embeddings": true when embeddings are configured; each create then carries its vector.)
-- Returns {"replaced": 0 or 1, "created": n, "history_deleted": n}. Raises SQLSTATE CN001 when
-- the operation is no longer the caller's (the fence), CN002 when a create cites a memory that
-- is not a remaining source of the observation. Either way nothing is written.
CREATE FUNCTION consolidation_rederive_v1(p jsonb)
RETURNS jsonb
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
DECLARE
    v_op        uuid   := (p->>'operation_id')::uuid;
    v_bank      text   := p->>'bank_id';
    v_obs       uuid   := (p->>'observation_id')::uuid;
    v_forgotten uuid[] := ARRAY(SELECT jsonb_array_elements_text(p->'forgotten'))::uuid[];
    v_scope     text[];
    v_remaining uuid[];
    v_lineage   uuid[];
    v_history   integer;
BEGIN
    IF NOT consolidation_holds_lease_v1(v_op, p->>'worker_id', (p->>'attempt')::integer) THEN
        RAISE EXCEPTION 'operation % attempt % is no longer owned by %',
            v_op, p->>'attempt', p->>'worker_id' USING ERRCODE = 'CN001';
    END IF;

    SELECT scope INTO v_scope FROM observations WHERE id = v_obs AND bank_id = v_bank FOR UPDATE;
    IF NOT FOUND THEN
        RETURN jsonb_build_object('replaced', 0, 'created', 0, 'history_deleted', 0);
    END IF;
    v_remaining := ARRAY(SELECT s.memory_id FROM observation_sources s
                         WHERE s.observation_id = v_obs AND s.memory_id <> ALL(v_forgotten));
    IF EXISTS (SELECT 1
               FROM jsonb_array_elements(p->'creates') AS c,
                    jsonb_array_elements_text(c->'memory_ids') AS m
               WHERE m::uuid <> ALL(v_remaining)) THEN
        RAISE EXCEPTION 're-derived observation cites a memory that is not a remaining source of %',
            v_obs USING ERRCODE = 'CN002';
    END IF;
    v_lineage := consolidation_lineage_v1(ARRAY[v_obs]);

    UPDATE consolidation_outcomes o
    SET observation_ids = n.ids,
        action = CASE WHEN cardinality(n.ids) = 0 THEN 'skipped' ELSE o.action END
    FROM (
        SELECT c.memory_id, c.scope,
               ARRAY(SELECT x FROM unnest(c.observation_ids) AS x WHERE x <> ALL(v_lineage))
               || ARRAY(SELECT (w->>'id')::uuid FROM jsonb_array_elements(p->'creates') AS w
                        WHERE w->'memory_ids' ? c.memory_id::text) AS ids
        FROM consolidation_outcomes c
        WHERE c.memory_id = ANY(v_remaining) AND c.scope = v_scope
    ) AS n
    WHERE o.memory_id = n.memory_id AND o.scope = n.scope;

    IF (p->>'embeddings')::boolean THEN
        -- Only with embeddings configured (the column exists then; plpgsql plans a statement
        -- when it first runs it): each new observation with the vector of its text.
        INSERT INTO observations (id, bank_id, scope, text, embedding, embedding_version)
        SELECT (c->>'id')::uuid, v_bank, v_scope, c->>'text', (c->>'embedding')::vector,
               CASE WHEN c->>'embedding' IS NOT NULL THEN 1 END
        FROM jsonb_array_elements(p->'creates') AS c;
    ELSE
        INSERT INTO observations (id, bank_id, scope, text)
        SELECT (c->>'id')::uuid, v_bank, v_scope, c->>'text'
        FROM jsonb_array_elements(p->'creates') AS c;
    END IF;

    INSERT INTO observation_sources (observation_id, memory_id, operation_id)
    SELECT (c->>'id')::uuid, m::uuid, v_op
    FROM jsonb_array_elements(p->'creates') AS c,
         jsonb_array_elements_text(c->'memory_ids') AS m
    ON CONFLICT DO NOTHING;

    DELETE FROM observation_history WHERE observation_id = ANY(v_lineage);
    GET DIAGNOSTICS v_history = ROW_COUNT;
    DELETE FROM observations WHERE id = v_obs;
    RETURN jsonb_build_object('replaced', 1, 'created', jsonb_array_length(p->'creates'),
                              'history_deleted', v_history);
END
$fn$;
