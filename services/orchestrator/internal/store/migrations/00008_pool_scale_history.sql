-- +goose Up
-- What an autoscaled pool's scale-downs look back on: the counts its
-- demand asked for within the scale-down window (JSON {since, last,
-- steps: [{at, want}]}). Kept with the pool, so that every orchestrator
-- replica scales it down on the same history.
ALTER TABLE orchestrator.pools ADD COLUMN scale_history jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE orchestrator.pools DROP COLUMN scale_history;
