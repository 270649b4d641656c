-- Schema version 5 (docs/contract.md §18): never reusing a fence after a restore.
-- `fence_floor`, one row: the store-wide floor of gateway-issued fences a restore sets, and
-- the restore epoch (how many restores this store went through). An external issuer's
-- resource is on hold after a restore until a raise made in the current epoch covers it: its
-- own (`fences.lifted`) or a glob's (`fence_raises`). Glob raises are rules, so they also
-- cover resources first seen later.
ALTER TABLE fences ADD COLUMN lifted INTEGER NOT NULL DEFAULT 0;

CREATE TABLE fence_floor (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    floor        INTEGER NOT NULL DEFAULT 0,
    epoch        INTEGER NOT NULL DEFAULT 0,
    restored_at  REAL                          -- when the latest restore was applied
);
INSERT INTO fence_floor (id) VALUES (1);

CREATE TABLE fence_raises (
    match      TEXT PRIMARY KEY,               -- a resource glob
    at_least   INTEGER NOT NULL,
    epoch      INTEGER NOT NULL,               -- the restore epoch of its latest raise
    raised_at  REAL NOT NULL
) WITHOUT ROWID;
