-- fence-gateway on SQLite. Times are epoch seconds (REAL) by the store's clock.

-- Per resource: the highest fence ever issued by the gateway and the highest ever accepted.
-- Never deleted, so fences survive lease records being swept.
CREATE TABLE IF NOT EXISTS fences (
    resource  TEXT PRIMARY KEY,
    issued    INTEGER NOT NULL DEFAULT 0,
    accepted  INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS leases (
    resource     TEXT PRIMARY KEY,
    owner        TEXT NOT NULL,
    fence        INTEGER NOT NULL,
    client       TEXT,
    acquire_key  TEXT,
    state        TEXT NOT NULL,              -- held | expired | released
    acquired_at  REAL NOT NULL,
    renewed_at   REAL NOT NULL,
    expires_at   REAL NOT NULL,
    ended_at     REAL                         -- when released or marked expired
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS leases_by_expiry ON leases (state, expires_at);

CREATE TABLE IF NOT EXISTS receipts (
    id                TEXT PRIMARY KEY,       -- sortable: creation order
    resource          TEXT NOT NULL,
    fence             INTEGER NOT NULL,
    owner             TEXT,
    client            TEXT,
    upstream          TEXT NOT NULL,
    method            TEXT NOT NULL,
    path              TEXT NOT NULL,
    idempotency_key   TEXT,
    fingerprint       TEXT,
    attempt           INTEGER,
    status            TEXT NOT NULL,
    http_status       INTEGER,
    error             TEXT,
    reject_code       TEXT,
    late              INTEGER NOT NULL DEFAULT 0,
    created_at        REAL NOT NULL,
    forwarded_at      REAL,
    completed_at      REAL,
    instance          TEXT NOT NULL,
    resolution        TEXT,                   -- JSON {"outcome","source","note","at"}
    replayable        INTEGER NOT NULL DEFAULT 0,
    response_headers  TEXT,                   -- JSON [[name, value], ...]
    response_body     BLOB
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS receipts_by_resource ON receipts (resource, id);
CREATE INDEX IF NOT EXISTS receipts_by_status ON receipts (status, id);
CREATE INDEX IF NOT EXISTS receipts_by_key ON receipts (idempotency_key, id);
CREATE INDEX IF NOT EXISTS receipts_by_completion ON receipts (status, completed_at);

-- An idempotency key, scoped to its resource, points at its latest non-rejected receipt.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    resource     TEXT NOT NULL,
    key          TEXT NOT NULL,
    receipt_id   TEXT NOT NULL,
    retention_s  REAL NOT NULL,
    expires_at   REAL,                        -- NULL while pending or outcome_unknown
    PRIMARY KEY (resource, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS keys_by_expiry ON idempotency_keys (expires_at);
CREATE INDEX IF NOT EXISTS keys_by_receipt ON idempotency_keys (receipt_id);

CREATE TABLE IF NOT EXISTS instances (
    id            TEXT PRIMARY KEY,
    started_at    REAL NOT NULL,
    heartbeat_at  REAL NOT NULL
) WITHOUT ROWID;

-- Sweeper cleanups (docs/contract.md §9) still owed: a resource whose expired lease's rule has `on_expiry`.
-- Written with the expiry, deleted once the call is known to have happened or a new owner
-- took the resource over, so failed calls are retried and restarts lose nothing.
CREATE TABLE IF NOT EXISTS cleanups (
    resource     TEXT PRIMARY KEY,
    lease_fence  INTEGER NOT NULL,            -- the fence of the lease that expired
    lease_owner  TEXT NOT NULL,
    due_at       REAL NOT NULL,               -- expires_at + lock_delay_s; later after a try
    attempts     INTEGER NOT NULL DEFAULT 0,
    sweep_fence  INTEGER,                     -- the sweeper's lease of the latest attempt
    last_error   TEXT,
    created_at   REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS cleanups_by_due ON cleanups (due_at);
