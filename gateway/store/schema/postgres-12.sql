-- Schema version 12: lists are ordered by the transaction that admitted each receipt
-- (gateway/store/postgres_lists.py), so that a cursor never skips a receipt whose admission
-- commits after a later one's (docs/contract.md §7). Receipts written before this version
-- sort first, by id, as they did: `0` is older than any transaction.
ALTER TABLE receipts ADD COLUMN admitted_by xid8 NOT NULL DEFAULT '0';
ALTER TABLE receipts ALTER COLUMN admitted_by SET DEFAULT pg_current_xact_id();
CREATE INDEX receipts_by_admission ON receipts (admitted_by, id);
-- The reconciliation queue and the other lists of one status, in the same order.
DROP INDEX receipts_by_status;
CREATE INDEX receipts_by_status ON receipts (status, admitted_by, id);
