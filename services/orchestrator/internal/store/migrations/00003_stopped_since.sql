-- +goose Up
-- When the proxy's instance was first seen stopped (NULL while it is not):
-- a stopped instance is replaced once it has been stopped for longer than
-- the grace period.
ALTER TABLE orchestrator.proxies ADD COLUMN stopped_since timestamptz;

-- +goose Down
ALTER TABLE orchestrator.proxies DROP COLUMN stopped_since;
