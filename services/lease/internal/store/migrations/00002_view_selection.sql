-- +goose Up

-- Selection moved into each replica's in-memory view of the proxy mirror; the
-- database only confirms a choice by primary key. Without an index on
-- active_leases and last_lease_time, the two updates every lease makes to
-- its proxy's row are HOT updates: no index entry is written and no dead
-- one piles up between vacuums.
DROP INDEX lease.proxies_pick;

-- Every lease row is written three times (acquire, report, release). Room
-- left in each page lets the report's update stay on the page as a HOT
-- update. Lease ids are now version 7 UUIDs, which start with the
-- acquisition time, so the purge reads old leases as a range of the
-- primary key and the index on acquire_time goes: a lease writes two
-- B-tree entries fewer.
ALTER TABLE lease.leases SET (fillfactor = 60);
DROP INDEX lease.leases_acquired;

-- +goose Down
CREATE INDEX leases_acquired ON lease.leases (acquire_time);
ALTER TABLE lease.leases RESET (fillfactor);
CREATE INDEX proxies_pick ON lease.proxies (active_leases, last_lease_time NULLS FIRST, tiebreak) WHERE leasable;
