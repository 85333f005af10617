-- +goose Up

-- A resync marks deleted the stored proxies missing from the listing whose
-- snapshot was stored before the listing began. "Before" is decided by the
-- transaction that stored the snapshot: it was committed before the
-- resync took its mark, a pg_snapshot (visible in it). The value of a
-- sequence taken while storing could not say so: an apply that took its
-- value before the mark and committed after it looked older than the
-- listing, and a proxy created during the listing was marked deleted.
-- The applied column and its sequence stay for the previous release.
ALTER TABLE lease.proxies ADD COLUMN applied_xact xid8 NOT NULL DEFAULT pg_current_xact_id();

-- +goose Down
ALTER TABLE lease.proxies DROP COLUMN applied_xact;
