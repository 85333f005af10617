-- +goose Up
-- A provider's readiness carries a message naming the failing targets, and
-- the time it last changed (NULL for records written before: set by the
-- next check).
ALTER TABLE health.provider_health ADD COLUMN message text NOT NULL DEFAULT '';
ALTER TABLE health.provider_health ADD COLUMN readiness_transition_time timestamptz;

-- +goose Down
ALTER TABLE health.provider_health DROP COLUMN readiness_transition_time;
ALTER TABLE health.provider_health DROP COLUMN message;
