-- Schema version 4 (docs/contract.md §17): checkpoints of long tasks, appended by the
-- resource's current owner, numbered 1, 2, … per resource. `state` is compact JSON text.
-- A checkpoint is deleted past `expires_at` (its rule's idempotency.retention_s after it was
-- written), except the resource's last one, which is always kept: so `seq` is never reused.
CREATE TABLE IF NOT EXISTS checkpoints (
    resource    TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    fence       INTEGER NOT NULL,
    owner       TEXT,
    client      TEXT,
    step        TEXT NOT NULL,
    state       TEXT NOT NULL,
    at          REAL NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (resource, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS checkpoints_by_expiry ON checkpoints (expires_at);
