-- Schema version 10: `admit_fresh` reads only the receipts its answer depends on, whatever
-- plan a connection makes for it; `record_outcomes` records many outcomes in one statement.
--
-- Its plpgsql statements are planned once per connection, and generic plans made while
-- `receipts` was empty (a new database, its first calls) read far more than they needed, more
-- as the table grew, until an ANALYZE replanned them:
--
-- * the check for a receipt this instance made after the id used `receipts_by_key` for
--   `resource = $1` alone and read every receipt of the resource from the heap to test
--   `id > $2` (280 heap fetches a call at 64 resources after 10 s of load). Asked as "this
--   instance's latest receipt after the id, in id order", both conditions go to the primary
--   key on an empty table and on a full one: it reads the receipts made after the id, as
--   many as admissions were in flight;
-- * the calls ahead, `fence < p_fence OR turn < taken_turn`, read every pending call of the
--   resource, because a plan for any turn cannot leave out the NULL turn of a call outside a
--   serial rule. The fence is asked alone (a range of `receipts_pending`), the turn only for
--   a serial call.
CREATE OR REPLACE FUNCTION admit_fresh_declines(
    p_resource text,
    p_fence bigint,
    p_key text,
    p_id text,
    p_instance text,
    p_accepted bigint,
    p_lifted bigint
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN p_fence < p_accepted
        OR EXISTS (SELECT 1 FROM fence_floor WHERE id = 1 AND epoch > p_lifted)  -- a hold?
        OR EXISTS (SELECT 1 FROM fence_raises WHERE at_least > p_fence)
        OR EXISTS (SELECT 1 FROM idempotency_keys WHERE resource = p_resource AND key = p_key)
        OR EXISTS (SELECT 1 FROM receipts WHERE resource = p_resource
                   AND idempotency_key = p_key AND status <> 'rejected')
        -- A receipt this instance made after the id was (a call that took the lock first):
        -- the full admission makes a new id under the lock, so ids keep the order receipts
        -- were created in (docs/contract.md §7).
        OR (SELECT id FROM receipts WHERE resource = p_resource AND id > p_id
            AND instance = p_instance ORDER BY id DESC LIMIT 1) IS NOT NULL;
END
$$;

CREATE OR REPLACE FUNCTION admit_fresh(
    p_resource text,
    p_id text,
    p_fence bigint,
    p_owner text,
    p_client text,
    p_upstream text,
    p_method text,
    p_path text,
    p_key text,
    p_fingerprint text,
    p_attempt integer,
    p_instance text,
    p_retention_s double precision,
    p_serial integer,            -- 1 for a call under a serial rule: it takes the next turn
    p_mcp text,
    p_trace_id text
) RETURNS TABLE (taken_turn bigint, ahead boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    locked fences%ROWTYPE;
    made boolean := false;
    now_s double precision;
BEGIN
    SELECT * INTO locked FROM fences WHERE resource = p_resource;
    IF admit_fresh_declines(p_resource, p_fence, p_key, p_id, p_instance,
                            coalesce(locked.accepted, 0), coalesce(locked.lifted, 0)) THEN
        RETURN;  -- nothing locked, nothing written
    END IF;
    SELECT * INTO locked FROM fences WHERE resource = p_resource FOR UPDATE;
    IF NOT FOUND THEN  -- a resource never seen: its row is made, and locked, as the full path does
        INSERT INTO fences (resource) VALUES (p_resource) ON CONFLICT (resource)
            DO UPDATE SET issued = fences.issued RETURNING * INTO locked;
        made := true;
    END IF;
    -- Again under the lock: what changed since the look before decides.
    IF admit_fresh_declines(p_resource, p_fence, p_key, p_id, p_instance,
                            locked.accepted, locked.lifted) THEN
        IF made THEN  -- not even the fences row stays: the statement is undone
            RAISE EXCEPTION 'admit_fresh declined' USING ERRCODE = 'FG001';
        END IF;
        RETURN;
    END IF;

    now_s := extract(epoch from clock_timestamp())::float8;
    UPDATE fences SET accepted = greatest(accepted, p_fence), turns = turns + p_serial
        WHERE resource = p_resource
        RETURNING CASE WHEN p_serial = 1 THEN turns END INTO taken_turn;
    -- The calls that must go first, admitted before this one and still pending on any replica:
    -- a lower fence (a range of `receipts_pending`), then, for a serial call, a lower turn.
    ahead := EXISTS (SELECT 1 FROM receipts o WHERE o.resource = p_resource
                     AND o.status = 'pending' AND o.fence < p_fence)
        OR (taken_turn IS NOT NULL AND EXISTS (SELECT 1 FROM receipts o
            WHERE o.resource = p_resource AND o.status = 'pending' AND o.turn < taken_turn));
    INSERT INTO idempotency_keys (resource, key, receipt_id, retention_s, expires_at)
        VALUES (p_resource, p_key, p_id, p_retention_s, NULL)
        ON CONFLICT (resource, key) DO UPDATE SET receipt_id = excluded.receipt_id,
        retention_s = excluded.retention_s, expires_at = NULL;
    INSERT INTO receipts (id, resource, fence, owner, client, upstream, method, path,
        idempotency_key, fingerprint, attempt, status, created_at, forwarded_at, instance, turn,
        mcp, trace_id)
        VALUES (p_id, p_resource, p_fence, p_owner, p_client, p_upstream, p_method, p_path,
        p_key, p_fingerprint, p_attempt, 'pending', now_s, now_s, p_instance, taken_turn,
        p_mcp, p_trace_id);
    RETURN NEXT;
END
$$;

-- The outcomes of calls whose receipts are `pending`, recorded together: one statement and
-- one commit for all the outcomes a replica has ready at once, where each took a statement, a
-- commit and a round trip of its own. Element i of every array is one outcome: the receipt's
-- id, then what it stores (a session object of NULL keeps the one there), whether it is late
-- and whether it settles the key (its retention starts). Each is recorded as one alone would
-- be, in the order given; the ids recorded are returned, and one not returned was no longer
-- `pending`: the gateway decides its outcome alone.
--
-- One statement per receipt, not one over all of them: the single-row plans are the ones a
-- connection keeps safely (an index for each), where a join of the arrays with `receipts`,
-- planned while the table was empty, could read all of it. `coalesce` on a NOT NULL column
-- changes nothing but the plan: written `status = 'pending'`, a plan made on an empty table
-- took the partial index `receipts_pending` and read every pending call's entry in it to
-- find the one id; written this way no index serves it, and `receipts_by_id` finds the row.
CREATE FUNCTION record_outcomes(
    p_ids text[],
    p_statuses text[],
    p_http_statuses integer[],
    p_errors text[],
    p_forwarded_at double precision[],
    p_replayable boolean[],
    p_headers text[],
    p_bodies bytea[],
    p_sessions text[],
    p_late boolean[],
    p_settles boolean[]
) RETURNS SETOF text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_resource text;
    v_key text;
    v_completed double precision;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_ids, 1), 0) LOOP
        UPDATE receipts SET status = p_statuses[i], http_status = p_http_statuses[i],
            error = p_errors[i], late = p_late[i], forwarded_at = p_forwarded_at[i],
            completed_at = extract(epoch from clock_timestamp())::float8,
            replayable = p_replayable[i], response_headers = p_headers[i],
            response_body = p_bodies[i], session = coalesce(p_sessions[i], session)
            WHERE id = p_ids[i] AND coalesce(status, '') = 'pending'
            RETURNING resource, idempotency_key, completed_at
            INTO v_resource, v_key, v_completed;
        CONTINUE WHEN NOT FOUND;
        IF p_settles[i] THEN
            UPDATE idempotency_keys k SET expires_at = v_completed + k.retention_s
                WHERE k.resource = v_resource AND k.key = v_key AND k.receipt_id = p_ids[i];
        END IF;
        RETURN NEXT p_ids[i];
    END LOOP;
END
$$;
