-- +goose Up
-- A proxy's pool (empty for none) and whether it drains: a draining proxy
-- keeps its leases but takes no new one, so it is no longer leasable.
-- refusals counts, per pool, the acquires refused for lack of a proxy; the
-- demand publisher reports the growth of the count.
ALTER TABLE lease.proxies
    ADD COLUMN pool     text    NOT NULL DEFAULT '',
    ADD COLUMN draining boolean NOT NULL DEFAULT false;
ALTER TABLE lease.proxies DROP COLUMN leasable;
ALTER TABLE lease.proxies ADD COLUMN leasable boolean GENERATED ALWAYS AS
    (ready AND healthy AND NOT deleted AND NOT draining AND host <> '' AND port > 0) STORED;
CREATE INDEX proxies_pool ON lease.proxies (pool) WHERE pool <> '' AND NOT deleted;

CREATE TABLE lease.refusals (
    pool    text   PRIMARY KEY,
    refused bigint NOT NULL DEFAULT 0
);

-- +goose Down
DROP TABLE lease.refusals;
DROP INDEX lease.proxies_pool;
ALTER TABLE lease.proxies DROP COLUMN leasable;
ALTER TABLE lease.proxies ADD COLUMN leasable boolean GENERATED ALWAYS AS
    (ready AND healthy AND NOT deleted AND host <> '' AND port > 0) STORED;
ALTER TABLE lease.proxies DROP COLUMN pool, DROP COLUMN draining;
