-- +goose Up
-- One row per proxy: desired state (spec, labels), observed status, the
-- reconcile queue (next_attempt_time, attempts) and the one command in
-- flight. spec is the protobuf encoding of egress.proxy.v1.ProxySpec; the
-- columns beside it are what queries filter on.
CREATE TABLE orchestrator.proxies (
    uid                    uuid PRIMARY KEY,
    name                   text NOT NULL UNIQUE,
    labels                 jsonb NOT NULL DEFAULT '{}',
    spec                   bytea NOT NULL,
    mode                   smallint NOT NULL,
    provider               text NOT NULL DEFAULT '',
    spec_hash              text NOT NULL DEFAULT '',
    skip_cleanup           boolean NOT NULL DEFAULT false,
    generation             bigint NOT NULL DEFAULT 1,
    revision               bigint NOT NULL,
    create_time            timestamptz NOT NULL,
    update_time            timestamptz NOT NULL,
    delete_time            timestamptz,

    phase                  smallint NOT NULL,
    provider_id            text NOT NULL DEFAULT '',
    ip                     text NOT NULL DEFAULT '',
    port                   integer NOT NULL DEFAULT 0,
    healthy                boolean NOT NULL DEFAULT false,
    reason                 text NOT NULL DEFAULT '',
    message                text NOT NULL DEFAULT '',
    instance_spec_hash     text NOT NULL DEFAULT '',
    failed_spec_hash       text NOT NULL DEFAULT '',
    observed_generation    bigint NOT NULL DEFAULT 0,
    phase_transition_time  timestamptz,
    health_transition_time timestamptz,
    probe_latency_us       bigint NOT NULL DEFAULT 0,
    health_sequence        bigint NOT NULL DEFAULT 0,

    next_attempt_time      timestamptz,
    attempts               integer NOT NULL DEFAULT 0,
    command_id             uuid,
    command_step           smallint NOT NULL DEFAULT 0,
    command_spec_hash      text NOT NULL DEFAULT '',
    command_deadline       timestamptz,
    command_issue_time     timestamptz
);

-- Due work, in due order.
CREATE INDEX proxies_due ON orchestrator.proxies (next_attempt_time) WHERE next_attempt_time IS NOT NULL;
CREATE INDEX proxies_provider ON orchestrator.proxies (provider, name);

-- Every change of a proxy, in commit order: the Watch log and the outbox
-- of ProxyEvents. snapshot is the egress.proxy.v1.Proxy after the change
-- (without cloud_init).
CREATE TABLE orchestrator.changes (
    revision    bigint PRIMARY KEY,
    uid         uuid NOT NULL,
    change_type smallint NOT NULL,
    snapshot    bytea NOT NULL,
    change_time timestamptz NOT NULL DEFAULT now()
);

-- The revision counter. Taking it is the last statement of every writing
-- transaction, and its row lock is held until commit, so revisions become
-- visible in commit order and a watcher never skips one.
CREATE TABLE orchestrator.revision (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    value     bigint NOT NULL
);
INSERT INTO orchestrator.revision (value) VALUES (0);

-- How far the ProxyEvent publisher has got through changes.
CREATE TABLE orchestrator.event_cursor (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    revision  bigint NOT NULL
);
INSERT INTO orchestrator.event_cursor (revision) VALUES (0);

-- +goose Down
DROP TABLE orchestrator.event_cursor;
DROP TABLE orchestrator.revision;
DROP TABLE orchestrator.changes;
DROP TABLE orchestrator.proxies;
