-- Schema version 5 (docs/contract.md §17): checkpoints of long tasks, appended by the
-- resource's current owner under the lock of its `fences` row, numbered 1, 2, … per
-- resource. `state` is compact JSON text (kept as sent: jsonb would reorder its keys).
-- A checkpoint is kept for its rule's idempotency.retention_s after it was written, and the
-- resource's last one always: its `expires_at` is NULL until a newer one is appended (then it
-- is `at` + `retention_s`), so the sweeper finds exactly the deletable rows by that index, and
-- `seq` is never reused.
CREATE TABLE checkpoints (
    resource    text COLLATE "C" NOT NULL,
    seq         bigint NOT NULL,
    fence       bigint NOT NULL,
    owner       text,
    client      text,
    step        text NOT NULL,
    state       text NOT NULL,
    at          double precision NOT NULL,
    mark        text COLLATE "C" NOT NULL,  -- its place in receipt-id order
    retention_s double precision NOT NULL,
    expires_at  double precision,
    PRIMARY KEY (resource, seq)
);
CREATE INDEX checkpoints_by_expiry ON checkpoints (expires_at) WHERE expires_at IS NOT NULL;
