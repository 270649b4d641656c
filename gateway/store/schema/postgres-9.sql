-- Schema version 9 (docs/contract.md §3 steps 4 to 6, §4, §14): an admission in one round trip.
--
-- `admit_fresh` admits a call under an external issuer's token with an idempotency key that
-- nothing holds yet, in the one state where the fence check and the key table say "admit, as
-- attempt 1" without reading more: the token at or above the resource's highest accepted
-- fence and no raise above it (§18), the resource not on hold after a restore, no key record
-- and no earlier attempt with the key. The gateway asks `gateway.core.fences.check` and
-- `gateway.core.idempotency.decide` first what they answer in that state (the owner the
-- receipt records, the attempt) and passes it in. In any other state the function writes
-- nothing and returns no row, and the gateway runs the full admission, which reads everything
-- and asks the same functions.
--
-- It takes the lock the full admission takes first, the resource's `fences` row, and every
-- statement after it sees what was committed before it began (a VOLATILE plpgsql function
-- under READ COMMITTED takes a fresh snapshot for each statement): what it admits on is read
-- after the lock, as the full admission reads it. It looks once before the lock too, so that
-- a call it leaves to the full admission (a stale token, a replay, a key in use) is left
-- without taking the lock, a write whose commit would wait for the disk. The fence advances,
-- the key is claimed and the receipt is written in the same statement, so in the same
-- commit. The receipt's id is made by the gateway before the statement waits for the lock; it
-- is used only if it still sorts after every receipt of the resource this instance made.

-- Whether `admit_fresh` leaves the call to the full admission, on what is committed when it
-- is asked: `p_accepted` and `p_lifted` are the resource's fences row's (0 without one).
-- plpgsql, so that its plan is kept for the connection (a SQL function is planned anew on
-- every call from plpgsql).
CREATE FUNCTION admit_fresh_declines(
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
        OR EXISTS (SELECT 1 FROM receipts WHERE resource = p_resource AND id > p_id
                   AND instance = p_instance);
END
$$;

CREATE FUNCTION admit_fresh(
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
    -- The calls that must go first, admitted before this one and still pending on any replica.
    ahead := EXISTS (SELECT 1 FROM receipts o WHERE o.resource = p_resource
                     AND o.status = 'pending' AND (o.fence < p_fence OR o.turn < taken_turn));
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
