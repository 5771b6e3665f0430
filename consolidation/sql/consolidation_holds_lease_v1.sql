-- The fence (DESIGN §4): is attempt p_attempt of operation p_operation still owned by p_worker?
-- The one definition every fenced write uses: the apply of a pass, the wave's markers, and every
-- write of queue.py (heartbeat, progress, final status, hand-back).
--
-- FOR SHARE locks the operation row until the caller's transaction ends, and reads its newest
-- version (waiting for a concurrent writer first): a reclaim, which updates the row, therefore
-- waits until the fenced write has committed, so the new owner sees everything it wrote; and a
-- fenced write that waited behind a reclaim sees the new owner and writes nothing.
CREATE FUNCTION consolidation_holds_lease_v1(p_operation uuid, p_worker text, p_attempt integer)
RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
BEGIN
    PERFORM 1 FROM operations
    WHERE id = p_operation AND worker_id = p_worker AND attempt = p_attempt
      AND status = 'running'
    FOR SHARE;
    RETURN FOUND;
END
$fn$;
