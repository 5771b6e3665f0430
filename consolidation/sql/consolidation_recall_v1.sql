-- The observations of one scope a pass should see (DESIGN §2, Recall): full-text matches of the
-- batch's facts (any of their lexemes), best first, topped up with the most recently updated,
-- p_limit in all.
--
-- enable_seqscan = off: the plan is cached per session when a bank's first passes run, often
-- while the statistics still say the tables are empty; a sequential scan planned then would be
-- kept while the tables grow. Every lookup here is by key.
CREATE FUNCTION consolidation_recall_v1(p_bank text, p_scope text[], p_limit integer, p_text text)
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
