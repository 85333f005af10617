-- +goose Up
-- The W3C traceparent of the API call that last set the proxy in motion,
-- kept while it converges so that the reconcile claims, commands and
-- results continue that call's trace.
ALTER TABLE orchestrator.proxies ADD COLUMN trace_parent text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE orchestrator.proxies DROP COLUMN trace_parent;
