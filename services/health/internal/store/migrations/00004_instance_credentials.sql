-- +goose Up
-- An instance is its provider ID and the time its credentials were made.
-- A backend that names an instance after its proxy (local, Kubernetes)
-- replaces it under the same provider ID, and the new instance gets new
-- credentials: so a verdict reached for the old instance is neither taken
-- over for the new one nor mistaken for a repeat of the new one's first.
-- NULL: the proxy has no credentials.
ALTER TABLE health.transitions ADD COLUMN credentials_time timestamptz;
ALTER TABLE health.proxy_health ADD COLUMN credentials_time timestamptz;

-- +goose Down
ALTER TABLE health.proxy_health DROP COLUMN credentials_time;
ALTER TABLE health.transitions DROP COLUMN credentials_time;
