-- +goose Up
-- A session is a client's lease under a key it chose: acquiring again with
-- the key returns the session's active lease while its proxy can serve,
-- from any replica. The unique index is the rule itself: one active lease
-- per client and key, whatever the replicas do at once. A session that
-- leaves an unusable proxy ends its lease as 'moved'.
ALTER TABLE lease.leases ADD COLUMN session_key text NOT NULL DEFAULT '';
CREATE UNIQUE INDEX leases_session ON lease.leases (client_id, session_key)
    WHERE end_reason IS NULL AND session_key <> '';
ALTER TABLE lease.leases DROP CONSTRAINT leases_end_reason_check;
ALTER TABLE lease.leases ADD CONSTRAINT leases_end_reason_check
    CHECK (end_reason IN ('released', 'expired', 'moved'));

-- +goose Down
ALTER TABLE lease.leases DROP CONSTRAINT leases_end_reason_check;
UPDATE lease.leases SET end_reason = 'released' WHERE end_reason = 'moved';
ALTER TABLE lease.leases ADD CONSTRAINT leases_end_reason_check
    CHECK (end_reason IN ('released', 'expired'));
DROP INDEX lease.leases_session;
ALTER TABLE lease.leases DROP COLUMN session_key;
