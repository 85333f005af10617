-- +goose Up
-- The draining proxies, for the pool controller's sweep of those of no
-- pool (DrainingAlone), which runs after every change: without it the
-- sweep read every proxy, a cost that grew with the fleet.
CREATE INDEX proxies_draining ON orchestrator.proxies (name) WHERE drain_time IS NOT NULL;

-- +goose Down
DROP INDEX orchestrator.proxies_draining;
