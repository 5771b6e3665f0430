-- The lineage of some observations: themselves and every observation merged into them, however
-- long ago (observation_history keeps a 'merged_away' row naming the one each was merged into).
-- Every text that ever went into them is in the history rows of their lineage.
CREATE FUNCTION consolidation_lineage_v1(p_observations uuid[])
RETURNS uuid[]
LANGUAGE sql STABLE SET enable_seqscan = off AS $fn$
    WITH RECURSIVE lineage(id) AS (
        SELECT unnest(p_observations)
        UNION
        SELECT h.observation_id
        FROM observation_history h JOIN lineage l ON h.merged_into = l.id
        WHERE h.action = 'merged_away'
    )
    SELECT COALESCE(array_agg(id), '{}') FROM lineage
$fn$;
