-- Schema version 8 (docs/contract.md §19): the epochs the store has served in. An epoch is
-- the server's system identifier and live timeline; a new one (a failover, a promotion, a
-- restore into another cluster, a WAL position gone back) is recorded once, under an
-- advisory lock, before anything is admitted in it, with the replication mode it is served
-- in and whether recording it applied the §18 floor (NULL: the store's first epoch).
CREATE TABLE store_epochs (
    id           bigserial PRIMARY KEY,
    system_id    text NOT NULL,
    timeline     integer NOT NULL,
    wal_lsn      bigint NOT NULL,            -- the WAL insert position it was recorded at
    mode         text NOT NULL CHECK (mode IN ('async', 'sync')),
    floor        text CHECK (floor IN ('applied', 'not_needed')),
    reason       text NOT NULL,
    recorded_at  double precision NOT NULL,
    recorded_by  text NOT NULL               -- the instance that recorded it
);
