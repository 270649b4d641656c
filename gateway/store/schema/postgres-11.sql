-- Schema version 11: an outcome keeps the receipt's `forwarded_at`, the database's time of
-- its admission (or of its leaving, after a wait): the replica's own clock, which the outcome
-- carries, no longer decides when the receipt becomes reconcilable (docs/contract.md §14).
CREATE OR REPLACE FUNCTION record_outcomes(
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
            error = p_errors[i], late = p_late[i],
            forwarded_at = CASE WHEN p_forwarded_at[i] IS NOT NULL
                THEN coalesce(forwarded_at, p_forwarded_at[i]) END,
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
