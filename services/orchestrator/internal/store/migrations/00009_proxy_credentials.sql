-- +goose Up
-- A proxy's credentials (HTTP Basic Proxy-Authorization), sealed with the
-- cloud-init keyring like cloud-init: credentials is the sealed value,
-- credentials_key the id of the key that sealed it ('' when the proxy has
-- none), credentials_time when they were made. credentials_stale marks an
-- instance that still runs with older credentials than these.
ALTER TABLE orchestrator.proxies
    ADD COLUMN credentials bytea,
    ADD COLUMN credentials_key text NOT NULL DEFAULT '',
    ADD COLUMN credentials_time timestamptz,
    ADD COLUMN credentials_stale boolean NOT NULL DEFAULT false;

-- +goose Down
ALTER TABLE orchestrator.proxies DROP COLUMN credentials, DROP COLUMN credentials_key,
    DROP COLUMN credentials_time, DROP COLUMN credentials_stale;
