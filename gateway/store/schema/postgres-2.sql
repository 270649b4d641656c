-- Schema version 2 (docs/contract.md §14): the calls of a resource in flight on any replica.
-- A replica waits, before forwarding, for the `pending` calls of its resource with a lower
-- fence, and for a `serial` resource for the ones admitted before it, wherever they were
-- admitted: the partial index finds them.

-- Serial calls of a resource are numbered in admission order, under the resource's lock.
ALTER TABLE fences ADD COLUMN turns bigint NOT NULL DEFAULT 0;
ALTER TABLE receipts ADD COLUMN turn bigint;  -- NULL unless admitted under a serial rule
CREATE INDEX receipts_pending ON receipts (resource, fence) WHERE status = 'pending';
