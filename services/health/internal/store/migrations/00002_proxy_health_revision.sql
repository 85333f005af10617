-- +goose Up
-- The revision of the proxy snapshot a state was written for: forgetting a
-- proxy's health when a snapshot says it is no longer probed removes only
-- what was written for that snapshot or an earlier one, never the state of
-- a later snapshot under which the proxy is probed again.
ALTER TABLE health.proxy_health ADD COLUMN revision bigint NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE health.proxy_health DROP COLUMN revision;
