-- +goose Up
-- Proxy pools: one row per pool holding its desired state (spec, the
-- protobuf encoding of egress.proxy.v1.ProxyPoolSpec without the template's
-- cloud-init, which is sealed in cloud_init like a proxy's) and what its
-- controller last observed and decided (status, the protobuf encoding of
-- egress.proxy.v1.ProxyPoolStatus).
CREATE TABLE orchestrator.pools (
    uid            uuid PRIMARY KEY,
    name           text NOT NULL UNIQUE,
    labels         jsonb NOT NULL DEFAULT '{}',
    spec           bytea NOT NULL,
    cloud_init     bytea,
    cloud_init_key text NOT NULL DEFAULT '',
    status         bytea NOT NULL,
    generation     bigint NOT NULL DEFAULT 1,
    revision       bigint NOT NULL,
    create_time    timestamptz NOT NULL,
    update_time    timestamptz NOT NULL,
    delete_time    timestamptz,
    -- When the pool's controller should look at it next.
    next_sync_time timestamptz NOT NULL DEFAULT now()
);

-- Every change of a pool, in commit order, with its own revision counter
-- (the Watch of pools); snapshot is the egress.proxy.v1.ProxyPool after
-- the change, without cloud-init.
CREATE TABLE orchestrator.pool_changes (
    revision    bigint PRIMARY KEY,
    uid         uuid NOT NULL,
    change_type smallint NOT NULL,
    snapshot    bytea NOT NULL,
    change_time timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE orchestrator.pool_revision (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    value     bigint NOT NULL
);
INSERT INTO orchestrator.pool_revision (value) VALUES (0);

-- A proxy's pool (empty for a proxy of its own) and its draining: when it
-- began and when the proxy is deleted regardless of its leases.
ALTER TABLE orchestrator.proxies
    ADD COLUMN pool           text NOT NULL DEFAULT '',
    ADD COLUMN drain_time     timestamptz,
    ADD COLUMN drain_deadline timestamptz;
CREATE INDEX proxies_pool ON orchestrator.proxies (pool, name) WHERE pool <> '';

-- +goose Down
DROP INDEX orchestrator.proxies_pool;
ALTER TABLE orchestrator.proxies DROP COLUMN pool, DROP COLUMN drain_time, DROP COLUMN drain_deadline;
DROP TABLE orchestrator.pool_revision;
DROP TABLE orchestrator.pool_changes;
DROP TABLE orchestrator.pools;
