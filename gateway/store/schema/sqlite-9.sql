-- Schema version 9: an outcome writes two index entries fewer. Each is a page its commit
-- writes to the WAL and syncs, which one call at a time waits for.
--
-- A key is kept while its latest receipt's `key_expires_at` is NULL (pending, or
-- outcome_unknown) or later than now: the admission that looks the key up decides it, so no
-- sweep has to find the keys that expired, and their index goes.
DROP INDEX receipts_by_key_expiry;
-- Retention finds settled receipts by status and id (receipts_by_status): a receipt's id is
-- made when it is created, before it completes, so one completed before a time has an id of
-- that time's millisecond or earlier (gateway.store.ids.id_ceiling).
DROP INDEX receipts_by_completion;
-- The keys as the table showed them: those whose receipt still keeps them.
DROP VIEW idempotency_keys;
CREATE VIEW idempotency_keys (resource, key, receipt_id, retention_s, expires_at) AS
    SELECT r.resource, r.idempotency_key, r.id, r.key_retention_s, r.key_expires_at
    FROM receipts r
    WHERE r.key_retention_s IS NOT NULL
      AND (r.key_expires_at IS NULL
           OR r.key_expires_at > (julianday('now') - 2440587.5) * 86400.0)
      AND r.id = (
        SELECT max(p.id) FROM receipts p
        WHERE p.idempotency_key = r.idempotency_key AND p.resource = r.resource
          AND p.status != 'rejected');
