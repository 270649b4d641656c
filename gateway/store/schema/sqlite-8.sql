-- Schema version 8: an idempotency key is kept on its receipts, not in a table of its own.
--
-- A key's state was a row of `idempotency_keys`, ordered by the key's hash, which every call
-- wrote twice (its admission, its outcome): each call's entry on a page of its own, where the
-- receipts' pages, ordered by time, are shared by the calls committed together. Now the key
-- is the latest receipt not rejected with that key on that resource (found by
-- receipts_by_key), and it is kept while that receipt's `key_retention_s` is set:
--   key_retention_s  the rule's retention for the key, set at admission; NULL for a receipt
--                    without a key, a rejection, and once the key is pruned;
--   key_expires_at   when the key may be pruned: its receipt's settlement + key_retention_s,
--                    NULL while it is pending or outcome_unknown (never pruned then).
-- An admission writes its receipt alone, an outcome updates it alone.
ALTER TABLE receipts ADD COLUMN key_retention_s REAL;
ALTER TABLE receipts ADD COLUMN key_expires_at REAL;
UPDATE receipts SET key_retention_s = k.retention_s, key_expires_at = k.expires_at
    FROM idempotency_keys k WHERE k.receipt_id = receipts.id;
DROP TABLE idempotency_keys;
-- Retention prunes keys by `key_expires_at < ?`: a receipt without one is left out.
CREATE INDEX receipts_by_key_expiry ON receipts (key_expires_at)
    WHERE key_expires_at IS NOT NULL;
-- The keys as the table showed them, for whoever reads them by hand.
CREATE VIEW idempotency_keys (resource, key, receipt_id, retention_s, expires_at) AS
    SELECT r.resource, r.idempotency_key, r.id, r.key_retention_s, r.key_expires_at
    FROM receipts r
    WHERE r.key_retention_s IS NOT NULL AND r.id = (
        SELECT max(p.id) FROM receipts p
        WHERE p.idempotency_key = r.idempotency_key AND p.resource = r.resource
          AND p.status != 'rejected');
