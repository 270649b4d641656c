-- Schema version 4 (docs/contract.md §17): checkpoints of long tasks, appended by the
-- resource's current owner, numbered 1, 2, … per resource. `state` is compact JSON text.
-- A checkpoint is kept for its rule's idempotency.retention_s after it was written, and the
-- resource's last one always: its `expires_at` is NULL until a newer one is appended (then it
-- is `at` + `retention_s`), so the sweeper finds exactly the deletable rows by that index, and
-- `seq` is never reused.
CREATE TABLE IF NOT EXISTS checkpoints (
    resource    TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    fence       INTEGER NOT NULL,
    owner       TEXT,
    client      TEXT,
    step        TEXT NOT NULL,
    state       TEXT NOT NULL,
    at          REAL NOT NULL,
    mark        TEXT NOT NULL,  -- its place in receipt-id order
    retention_s REAL NOT NULL,
    expires_at  REAL,
    PRIMARY KEY (resource, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS checkpoints_by_expiry ON checkpoints (expires_at)
    WHERE expires_at IS NOT NULL;
