-- +goose Up
-- A proxy's transitions by sequence: recording reads the last transition
-- of every proxy of a batch (is the new one a repeat?), and the publisher
-- looks for an older pending transition of the same proxy. Without it both
-- scanned the table, the first once per proxy that had none yet.
CREATE INDEX transitions_proxy ON health.transitions (proxy_uid, sequence);

-- +goose Down
DROP INDEX health.transitions_proxy;
