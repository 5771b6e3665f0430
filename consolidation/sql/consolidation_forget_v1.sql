-- Forget memories for good, in ONE transaction, once every observation that cited them and also
-- had other sources was replaced (consolidation_rederive_v1): delete the observations that still
-- cite them (they have no other source) and the history of their lineage; withhold the failure
-- reasons of the bank's other failed memories that share a write scope with them (a reason may
-- quote an answer that was given their content); delete the memories, whose write scopes,
-- journal rows and source rows go with them; stamp their tombstones. Memories already gone (an
-- earlier attempt committed this) are skipped, so a redo changes nothing.
--
-- p: {"operation_id", "worker_id", "attempt", "bank_id", "memory_ids": [memory id…]}
-- Returns {"memories", "observations_deleted", "history_deleted", "reasons_withheld"}. Raises
-- SQLSTATE CN001 when the operation is no longer the caller's (the fence), CN003 when an
-- observation citing them still has another source. Either way nothing is written.
CREATE FUNCTION consolidation_forget_v1(p jsonb)
RETURNS jsonb
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
DECLARE
    v_op           uuid := (p->>'operation_id')::uuid;
    v_bank         text := p->>'bank_id';
    v_ids          uuid[];
    v_affected     uuid[];
    v_history      integer;
    v_observations integer;
    v_reasons      integer;
    v_memories     integer;
BEGIN
    IF NOT consolidation_holds_lease_v1(v_op, p->>'worker_id', (p->>'attempt')::integer) THEN
        RAISE EXCEPTION 'operation % attempt % is no longer owned by %',
            v_op, p->>'attempt', p->>'worker_id' USING ERRCODE = 'CN001';
    END IF;

    v_ids := ARRAY(SELECT id FROM memories
                   WHERE id = ANY(ARRAY(SELECT jsonb_array_elements_text(p->'memory_ids'))::uuid[])
                     AND bank_id = v_bank AND forgotten_at IS NOT NULL
                   ORDER BY id
                   FOR UPDATE);
    v_affected := ARRAY(SELECT DISTINCT observation_id FROM observation_sources
                        WHERE memory_id = ANY(v_ids));
    IF EXISTS (SELECT 1 FROM observation_sources
               WHERE observation_id = ANY(v_affected) AND memory_id <> ALL(v_ids)) THEN
        RAISE EXCEPTION 'an observation citing a forgotten memory still has other sources'
            USING ERRCODE = 'CN003';
    END IF;

    DELETE FROM observation_history
    WHERE observation_id = ANY(consolidation_lineage_v1(v_affected));
    GET DIAGNOSTICS v_history = ROW_COUNT;
    DELETE FROM observations WHERE id = ANY(v_affected);
    GET DIAGNOSTICS v_observations = ROW_COUNT;

    UPDATE memories m
    SET consolidation_failed_reason = 'withheld: it may have quoted a memory that was forgotten'
    WHERE m.bank_id = v_bank
      AND m.consolidation_failed_at IS NOT NULL
      AND m.consolidation_failed_reason IS NOT NULL
      AND m.consolidation_failed_reason
          <> 'withheld: it may have quoted a memory that was forgotten'
      AND m.id <> ALL(v_ids)
      AND EXISTS (SELECT 1 FROM memory_scopes s
                  WHERE s.memory_id = m.id
                    AND s.scope IN (SELECT f.scope FROM memory_scopes f
                                    WHERE f.memory_id = ANY(v_ids)));
    GET DIAGNOSTICS v_reasons = ROW_COUNT;

    DELETE FROM memories WHERE id = ANY(v_ids);
    GET DIAGNOSTICS v_memories = ROW_COUNT;
    UPDATE forgotten_memories SET completed_at = now()
    WHERE memory_id = ANY(v_ids) AND completed_at IS NULL;

    RETURN jsonb_build_object('memories', v_memories, 'observations_deleted', v_observations,
                              'history_deleted', v_history, 'reasons_withheld', v_reasons);
END
$fn$;
