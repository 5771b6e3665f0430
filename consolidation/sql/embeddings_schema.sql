-- Embedding storage for hybrid recall (docs/architecture.md, Recall), only where pgvector is.
-- Idempotent: run by migration 0005 and again at start-up when embeddings are configured, so a
-- database whose server gained pgvector after the migration gets its columns then.
--   observations.embedding          the vector of the observation's text (any dimension: recall
--                                   only compares vectors of the query's dimension)
--   observations.embedding_version  the observation's version when that text was embedded; a
--                                   vector whose version is not the row's is stale and ignored
--                                   (an update by a worker without embeddings leaves it so)
-- Without pgvector on the server nothing happens: the schema is the one without embeddings.
DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'vector')
       AND EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector') THEN
        BEGIN
            CREATE EXTENSION IF NOT EXISTS vector;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'pgvector is available but this role may not create it: %', SQLERRM;
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'vector') THEN
        ALTER TABLE observations
            ADD COLUMN IF NOT EXISTS embedding vector,
            ADD COLUMN IF NOT EXISTS embedding_version integer;
    END IF;
END
$do$;
