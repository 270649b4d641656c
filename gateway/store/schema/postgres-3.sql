-- Schema version 3 (docs/contract.md §15): sessions. A receipt is a call's or a session's;
-- a session's receipt keeps its `session` object (JSON: opened_at, closed_at, closed_by,
-- close_code, message and byte counts). Receipts written before this version are calls.
ALTER TABLE receipts ADD COLUMN kind text NOT NULL DEFAULT 'call';
ALTER TABLE receipts ADD COLUMN session text;
