-- +goose Up
-- Every flip of a proxy's verdict (and its first verdict). The sequence is
-- strictly increasing across all proxies and replicas: inserts take a
-- transaction advisory lock, so sequences also commit in order and a reader
-- following "sequence > last seen" never skips one.
CREATE TABLE health.transitions (
    sequence        bigserial PRIMARY KEY,
    proxy_uid       text        NOT NULL,
    proxy_name      text        NOT NULL,
    provider_id     text        NOT NULL,
    healthy         boolean     NOT NULL,
    reason          text        NOT NULL,
    message         text        NOT NULL,
    latency_us      bigint      NOT NULL,
    transition_time timestamptz NOT NULL,
    prober          text        NOT NULL,
    -- Set once the HealthTransitionEvent is acknowledged by JetStream
    -- (the table is the outbox of the events).
    published       boolean     NOT NULL DEFAULT false
);
CREATE INDEX transitions_unpublished ON health.transitions (sequence) WHERE NOT published;
CREATE INDEX transitions_time ON health.transitions (transition_time);

-- The highest sequence removed by retention; WatchProxyHealth answers
-- OUT_OF_RANGE below it.
CREATE TABLE health.retention (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    pruned_through bigint  NOT NULL DEFAULT 0
);
INSERT INTO health.retention DEFAULT VALUES;

-- The current view of every probed proxy, written by the replica probing
-- it: on every transition, and in batches of changed states between.
CREATE TABLE health.proxy_health (
    proxy_uid             text PRIMARY KEY,
    proxy_name            text        NOT NULL,
    provider_id           text        NOT NULL,
    address               text        NOT NULL,
    verdict_known         boolean     NOT NULL,
    healthy               boolean     NOT NULL,
    reason                text        NOT NULL,
    message               text        NOT NULL,
    latency_us            bigint      NOT NULL,
    consecutive_successes integer     NOT NULL,
    consecutive_failures  integer     NOT NULL,
    last_probe_time       timestamptz,
    last_transition_time  timestamptz,
    prober                text        NOT NULL,
    updated_at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX proxy_health_name ON health.proxy_health (proxy_name, proxy_uid);

-- The latest check of every configured provider's backend.
CREATE TABLE health.provider_health (
    provider        text PRIMARY KEY,
    type            text        NOT NULL,
    readiness       integer     NOT NULL,
    reason          text        NOT NULL,
    targets         jsonb       NOT NULL,
    targets_ready   text        NOT NULL,
    last_check_time timestamptz NOT NULL
);

-- +goose Down
DROP TABLE health.provider_health;
DROP TABLE health.proxy_health;
DROP TABLE health.retention;
DROP TABLE health.transitions;
