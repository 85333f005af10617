-- +goose Up

-- Selection moved into each replica's in-memory view of the pool; the
-- database only confirms a choice by primary key. Without an index on
-- active_leases and last_lease_time, the two updates every lease makes to
-- its proxy's row are HOT updates: no index entry is written and no dead
-- one piles up between vacuums.
DROP INDEX lease.proxies_pick;

-- Every lease row is written three times (acquire, report, release). Room
-- left in each page lets the report's update stay on the page as a HOT
-- update, and the purge's index on acquire_time becomes a BRIN index
-- (acquire_time grows with the table), so a release writes one B-tree
-- entry instead of three.
ALTER TABLE lease.leases SET (fillfactor = 60);
DROP INDEX lease.leases_acquired;
CREATE INDEX leases_acquired ON lease.leases USING brin (acquire_time);

-- +goose Down
DROP INDEX lease.leases_acquired;
CREATE INDEX leases_acquired ON lease.leases (acquire_time);
ALTER TABLE lease.leases RESET (fillfactor);
CREATE INDEX proxies_pick ON lease.proxies (active_leases, last_lease_time NULLS FIRST, tiebreak) WHERE leasable;
