-- +goose Up
-- When the ProxyEvent publisher last republished every proxy's current
-- state, so that a proxy unchanged for longer than the event streams keep
-- a message does not vanish from them.
ALTER TABLE orchestrator.event_cursor ADD COLUMN refresh_time timestamptz NOT NULL DEFAULT now();

-- +goose Down
ALTER TABLE orchestrator.event_cursor DROP COLUMN refresh_time;
