-- +goose Up
-- Cloud-init leaves spec (whose protobuf bytes no longer carry it) for a
-- column of its own, encrypted with AES-256-GCM: cloud_init is the sealed
-- value, cloud_init_key the id of the keyring key that sealed it ('' when
-- the proxy has no cloud-init). Rows from before this migration keep NULL
-- in cloud_init_key and their cloud-init inside spec until the orchestrator
-- re-encrypts them, which it does at start (the key file is needed then).
ALTER TABLE orchestrator.proxies
    ADD COLUMN cloud_init bytea,
    ADD COLUMN cloud_init_key text;

-- +goose Down
-- Refuses while any cloud-init is encrypted: the plaintext cannot be put
-- back into spec from SQL.
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM orchestrator.proxies WHERE cloud_init_key <> '') THEN
        RAISE EXCEPTION 'encrypted cloud-init present; migrating down would lose it';
    END IF;
END $$;
-- +goose StatementEnd
ALTER TABLE orchestrator.proxies DROP COLUMN cloud_init, DROP COLUMN cloud_init_key;
