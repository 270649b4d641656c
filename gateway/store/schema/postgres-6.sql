-- Schema version 6 (docs/contract.md §18): never reusing a fence after a restore.
-- `fence_floor`, one row: the store-wide floor of gateway-issued fences a restore sets, and
-- the restore epoch (how many restores this store went through). An external issuer's
-- resource is on hold after a restore until a raise made in the current epoch covers it: its
-- own (`fences.lifted`) or a glob's (`fence_raises`). Glob raises are rules, so they also
-- cover resources first seen later. Admission reads both with the resource's lock (one
-- statement); a glob raise locks every known resource it covers.
ALTER TABLE fences ADD COLUMN lifted bigint NOT NULL DEFAULT 0;

CREATE TABLE fence_floor (
    id           integer PRIMARY KEY CHECK (id = 1),
    floor        bigint NOT NULL DEFAULT 0,
    epoch        bigint NOT NULL DEFAULT 0,
    restored_at  double precision             -- when the latest restore was applied
);
INSERT INTO fence_floor (id) VALUES (1);

CREATE TABLE fence_raises (
    match      text COLLATE "C" PRIMARY KEY,  -- a resource glob
    at_least   bigint NOT NULL,
    epoch      bigint NOT NULL,               -- the restore epoch of its latest raise
    raised_at  double precision NOT NULL
);
