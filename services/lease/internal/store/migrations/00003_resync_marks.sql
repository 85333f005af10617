-- +goose Up

-- A resync decides which proxies are gone by the orchestrator's listing,
-- not by revisions: after a reset of the orchestrator's database its
-- revisions start again from one, and proxies learnt at higher revisions
-- before the reset would never look older than the listing. Every applied
-- snapshot (event or resync page) takes the next value of this sequence;
-- a resync takes one before it lists, and a proxy missing from the listing
-- whose snapshot was applied before that mark is gone.
CREATE SEQUENCE lease.proxy_applied;
ALTER TABLE lease.proxies ADD COLUMN applied bigint NOT NULL DEFAULT nextval('lease.proxy_applied');

-- +goose Down
ALTER TABLE lease.proxies DROP COLUMN applied;
DROP SEQUENCE lease.proxy_applied;
