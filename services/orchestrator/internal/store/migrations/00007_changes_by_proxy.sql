-- +goose Up
-- A proxy's own changes, newest first (ListProxyChanges: the console's
-- timeline), without reading the whole retained log.
CREATE INDEX changes_uid ON orchestrator.changes (uid, revision);

-- +goose Down
DROP INDEX orchestrator.changes_uid;
