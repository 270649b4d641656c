-- Schema version 7: fewer index entries written per call; the same queries, each still an
-- index search. Every admission inserts a receipt and a key, every outcome updates both.
--
-- keys_by_receipt is gone: a key is found from its receipt by the primary key instead, the
-- receipt's own (resource, idempotency_key), which are the key's (a key only ever points at a
-- receipt admitted for it).
DROP INDEX IF EXISTS keys_by_receipt;
-- Retention looks for keys by `expires_at < ?` only: a key without one (its receipt pending
-- or outcome_unknown) is left out of the index, so admitting a call writes no entry.
DROP INDEX IF EXISTS keys_by_expiry;
CREATE INDEX keys_by_expiry ON idempotency_keys (expires_at) WHERE expires_at IS NOT NULL;
-- Retention looks for receipts by status and `completed_at < ?`: a receipt not yet completed
-- (pending, or outcome_unknown before it is reconciled) is left out, so admitting a call
-- writes no entry and its outcome one instead of moving one. Other reads by status use
-- receipts_by_status.
DROP INDEX IF EXISTS receipts_by_completion;
CREATE INDEX receipts_by_completion ON receipts (status, completed_at)
    WHERE completed_at IS NOT NULL;
