-- Schema version 5 (docs/contract.md §17): checkpoints of long tasks, appended by the
-- resource's current owner under the lock of its `fences` row, numbered 1, 2, … per
-- resource. `state` is compact JSON text (kept as sent: jsonb would reorder its keys).
-- A checkpoint is deleted past `expires_at` (its rule's idempotency.retention_s after it was
-- written), except the resource's last one, which is always kept: so `seq` is never reused.
CREATE TABLE checkpoints (
    resource    text COLLATE "C" NOT NULL,
    seq         bigint NOT NULL,
    fence       bigint NOT NULL,
    owner       text,
    client      text,
    step        text NOT NULL,
    state       text NOT NULL,
    at          double precision NOT NULL,
    expires_at  double precision NOT NULL,
    PRIMARY KEY (resource, seq)
);
CREATE INDEX checkpoints_by_expiry ON checkpoints (expires_at);
