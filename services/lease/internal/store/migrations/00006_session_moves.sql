-- +goose Up
-- Why a session's lease ended as 'moved'. When no proxy could take the
-- session in the round that ended it, the acquire was refused; the
-- session's next lease is then still a move from that one, for that
-- reason. The index finds a session's latest lease.
ALTER TABLE lease.leases ADD COLUMN move_reason text NOT NULL DEFAULT '';
CREATE INDEX leases_session_latest ON lease.leases (client_id, session_key, acquire_time DESC)
    WHERE session_key <> '';

-- +goose Down
DROP INDEX lease.leases_session_latest;
ALTER TABLE lease.leases DROP COLUMN move_reason;
