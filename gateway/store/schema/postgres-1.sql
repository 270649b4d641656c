-- fence-gateway on PostgreSQL, schema version 1 (docs/contract.md §14); later versions alter it.
-- Times are epoch seconds (double precision) by the database's clock, as on SQLite.
-- Every table but `instances` is keyed by its resource first. Text keys compare bytewise
-- (COLLATE "C"), so listings and cursors order as they do on SQLite.

-- Per resource: the highest fence ever issued by the gateway and the highest ever accepted.
-- Never deleted, so fences survive lease records being swept. Its row is also the lock every
-- transaction that decides about a resource takes first.
CREATE TABLE fences (
    resource  text COLLATE "C" PRIMARY KEY,
    issued    bigint NOT NULL DEFAULT 0,
    accepted  bigint NOT NULL DEFAULT 0
);

CREATE TABLE leases (
    resource     text COLLATE "C" PRIMARY KEY,
    owner        text NOT NULL,
    fence        bigint NOT NULL,
    client       text,
    acquire_key  text,
    state        text NOT NULL,              -- held | expired | released
    acquired_at  double precision NOT NULL,
    renewed_at   double precision NOT NULL,
    expires_at   double precision NOT NULL,
    ended_at     double precision             -- when released or marked expired
);
CREATE INDEX leases_by_expiry ON leases (state, expires_at);

CREATE TABLE receipts (
    resource          text COLLATE "C" NOT NULL,
    id                text COLLATE "C" NOT NULL,  -- sortable: creation order
    fence             bigint NOT NULL,
    owner             text,
    client            text,
    upstream          text NOT NULL,
    method            text NOT NULL,
    path              text NOT NULL,
    idempotency_key   text COLLATE "C",
    fingerprint       text,
    attempt           integer,
    status            text NOT NULL,
    http_status       integer,
    error             text,
    reject_code       text,
    late              boolean NOT NULL DEFAULT false,
    created_at        double precision NOT NULL,
    forwarded_at      double precision,
    completed_at      double precision,
    instance          text NOT NULL,
    resolution        text,                   -- JSON {"outcome","source","note","at"}
    replayable        boolean NOT NULL DEFAULT false,
    response_headers  text,                   -- JSON [[name, value], ...]
    response_body     bytea,
    PRIMARY KEY (resource, id)
);
CREATE UNIQUE INDEX receipts_by_id ON receipts (id);
CREATE INDEX receipts_by_status ON receipts (status, id);
CREATE INDEX receipts_by_key ON receipts (resource, idempotency_key);
CREATE INDEX receipts_by_completion ON receipts (status, completed_at);

-- An idempotency key, scoped to its resource, points at its latest non-rejected receipt.
CREATE TABLE idempotency_keys (
    resource     text COLLATE "C" NOT NULL,
    key          text COLLATE "C" NOT NULL,
    receipt_id   text COLLATE "C" NOT NULL,
    retention_s  double precision NOT NULL,
    expires_at   double precision,            -- NULL while pending or outcome_unknown
    PRIMARY KEY (resource, key)
);
CREATE INDEX keys_by_expiry ON idempotency_keys (expires_at);
CREATE INDEX keys_by_receipt ON idempotency_keys (receipt_id);

CREATE TABLE instances (
    id            text PRIMARY KEY,
    started_at    double precision NOT NULL,
    heartbeat_at  double precision NOT NULL
);

-- Sweeper cleanups (docs/contract.md §9) still owed: a resource whose expired lease's rule
-- has `on_expiry`. Written with the expiry, deleted once the call is known to have happened
-- or a new owner took the resource over.
CREATE TABLE cleanups (
    resource     text COLLATE "C" PRIMARY KEY,
    lease_fence  bigint NOT NULL,             -- the fence of the lease that expired
    lease_owner  text NOT NULL,
    due_at       double precision NOT NULL,   -- expires_at + lock_delay_s; later after a try
    attempts     integer NOT NULL DEFAULT 0,
    sweep_fence  bigint,                      -- the sweeper's lease of the latest attempt
    last_error   text,
    created_at   double precision NOT NULL
);
CREATE INDEX cleanups_by_due ON cleanups (due_at);
