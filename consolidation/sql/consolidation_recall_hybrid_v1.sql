-- Hybrid recall (docs/architecture.md, "Recall with embeddings"): the observations of one scope
-- a pass should see, ranked for each fact by full text AND by cosine similarity, the two
-- rankings fused, the facts' fused rankings interleaved, then topped up with the most recently
-- updated observations, capped at p_limit.
--   p_texts    the facts' texts, one per fact
--   p_vectors  the facts' vectors in pgvector's text form ('[x,y,…]'), aligned with p_texts;
--              NULL for a fact without one. Text, not vector[], so that this function can be
--              created on a server without pgvector: it is only called when embeddings are on.
--   p_fusion   how a fact's two rankings become one, each ranking counting its first p_limit
--              places, an observation at place p of a ranking scoring w / (p_rrf_k + p), w
--              being p_lexical_weight for full text and 1 for cosine:
--              'interleave' (the default) keeps its better score: the two rankings alternate;
--              'rrf' sums them (reciprocal-rank fusion): agreement between the rankings wins.
--              The benchmark's knobs: the engine always calls the defaults.
-- The full-text ranking weighs shared lexemes by their rarity in the scope (idf) and ignores
-- those in more than half of its observations: the name a person's every observation repeats
-- would otherwise rank noise level with a paraphrase. Rankings per fact, then interleaved
-- (each observation keeps its best place over the facts), so each fact of a pass gets its
-- best few. Only vectors of the query's dimension and of the observation's current version
-- count. The measurements behind these choices: docs/benchmarks.md, "Recall quality".
CREATE FUNCTION consolidation_recall_hybrid_v1(
    p_bank text, p_scope text[], p_limit integer, p_texts text[], p_vectors text[],
    p_fusion text DEFAULT 'interleave', p_rrf_k integer DEFAULT 60,
    p_lexical_weight float8 DEFAULT 1.0)
RETURNS TABLE (obs_id uuid, obs_text text, obs_updated_at timestamptz, obs_sources bigint)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $fn$
BEGIN
    RETURN QUERY
    WITH facts AS MATERIALIZED (
        SELECT f.n, f.v::vector AS v,
               tsvector_to_array(to_tsvector('english'::regconfig, coalesce(f.t, ''))) AS lexemes
        FROM unnest(p_texts, p_vectors) WITH ORDINALITY AS f(t, v, n)
    ), candidates AS MATERIALIZED (
        SELECT o.id, o.updated_at, o.search,
               CASE WHEN o.embedding_version = o.version THEN o.embedding END AS embedding
        FROM observations o
        WHERE o.bank_id = p_bank AND o.scope = p_scope
    ), size AS (
        SELECT count(*)::float8 AS n FROM candidates
    ), wanted AS (
        SELECT DISTINCT l.lexeme FROM facts f, unnest(f.lexemes) AS l(lexeme)
    ), postings AS MATERIALIZED (
        SELECT c.id, w.lexeme
        FROM candidates c, unnest(c.search) AS u, wanted w
        WHERE u.lexeme = w.lexeme
    ), idf AS (
        SELECT p.lexeme, ln(s.n / count(*)) AS weight
        FROM postings p, size s
        GROUP BY p.lexeme, s.n
        HAVING count(*) <= s.n / 2
    ), lexical AS (
        SELECT f.n, p.id, sum(i.weight) AS score
        FROM facts f, unnest(f.lexemes) AS l(lexeme), postings p, idf i
        WHERE p.lexeme = l.lexeme AND i.lexeme = l.lexeme
        GROUP BY f.n, p.id
    ), lexical_pos AS (
        SELECT x.n, x.id,
               row_number() OVER (PARTITION BY x.n ORDER BY x.score DESC, x.id) AS pos
        FROM lexical x
    ), cosine_pos AS (
        SELECT f.n, c.id,
               row_number() OVER (PARTITION BY f.n ORDER BY c.embedding <=> f.v,
                                                             c.updated_at DESC) AS pos
        FROM facts f, candidates c
        WHERE f.v IS NOT NULL AND c.embedding IS NOT NULL
          AND vector_dims(c.embedding) = vector_dims(f.v)
    ), fused AS (
        SELECT r.n, r.id,
               CASE WHEN p_fusion = 'rrf' THEN sum(r.weight / (p_rrf_k + r.pos))
                    ELSE max(r.weight / (p_rrf_k + r.pos)) END AS score
        FROM (SELECT l.n, l.id, l.pos, p_lexical_weight AS weight
              FROM lexical_pos l WHERE l.pos <= p_limit
              UNION ALL
              SELECT c.n, c.id, c.pos, 1.0::float8 FROM cosine_pos c WHERE c.pos <= p_limit) AS r
        GROUP BY r.n, r.id
    ), per_fact AS (
        SELECT u.id, u.score,
               row_number() OVER (PARTITION BY u.n ORDER BY u.score DESC, u.id) AS pos
        FROM fused u
    ), ranked AS (
        SELECT r.id, min(r.pos) AS pos, max(r.score) AS score
        FROM per_fact r
        GROUP BY r.id
        ORDER BY pos, score DESC, r.id
        LIMIT p_limit
    ), chosen AS (
        SELECT r.id, row_number() OVER (ORDER BY r.pos, r.score DESC, r.id) AS ord
        FROM ranked r
        UNION ALL
        SELECT recent.id, p_limit + row_number() OVER (ORDER BY recent.updated_at DESC)
        FROM (SELECT o.id, o.updated_at
              FROM observations o
              WHERE o.bank_id = p_bank AND o.scope = p_scope
                AND o.id NOT IN (SELECT r.id FROM ranked r)
              ORDER BY o.updated_at DESC
              LIMIT p_limit) AS recent
    )
    SELECT o.id, o.text, o.updated_at,
           (SELECT count(*) FROM observation_sources s WHERE s.observation_id = o.id)
    FROM chosen c JOIN observations o ON o.id = c.id
    ORDER BY c.ord
    LIMIT p_limit;
END
$fn$;
