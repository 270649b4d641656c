-- Schema version 6 (docs/contract.md §21): tracing. A receipt keeps the trace id (32 lowercase
-- hex digits) of its call when the gateway's span of it was sampled; null otherwise.
ALTER TABLE receipts ADD COLUMN trace_id TEXT;
