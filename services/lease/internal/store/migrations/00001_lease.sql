-- +goose Up

-- proxies is the lease service's proxy mirror: one row per proxy ever
-- seen, kept from the orchestrator's ProxyEvents (idempotent by revision),
-- the health service's transitions and full resyncs. A deleted proxy stays
-- as a tombstone so that a late, older event cannot bring it back.
CREATE TABLE lease.proxies (
    uid             text        PRIMARY KEY,
    name            text        NOT NULL,
    provider        text        NOT NULL DEFAULT '',
    region          text        NOT NULL DEFAULT '',
    zone            text        NOT NULL DEFAULT '',
    labels          jsonb       NOT NULL DEFAULT '{}',
    host            text        NOT NULL DEFAULT '',
    port            integer     NOT NULL DEFAULT 0,
    provider_id     text        NOT NULL DEFAULT '',
    -- phase is PROXY_PHASE_READY
    ready           boolean     NOT NULL DEFAULT false,
    healthy         boolean     NOT NULL DEFAULT false,
    -- when the verdict in healthy was reached (event or transition)
    health_time     timestamptz,
    health_sequence bigint      NOT NULL DEFAULT 0,
    deleted         boolean     NOT NULL DEFAULT false,
    -- spec.lease.max_leases: NULL takes the service default, 0 is unlimited
    max_leases      integer     CHECK (max_leases >= 0),
    revision        bigint      NOT NULL,
    active_leases   integer     NOT NULL DEFAULT 0 CHECK (active_leases >= 0),
    last_lease_time timestamptz,
    -- the stable random tie-break, derived from the uid
    tiebreak        bigint      NOT NULL,
    update_time     timestamptz NOT NULL,
    leasable        boolean     GENERATED ALWAYS AS
        (ready AND healthy AND NOT deleted AND host <> '' AND port > 0) STORED
);

-- The selection order, so that picking a proxy reads the index in order
-- and stops at the first row that qualifies.
CREATE INDEX proxies_pick ON lease.proxies (active_leases, last_lease_time NULLS FIRST, tiebreak) WHERE leasable;

-- leases holds active leases (end_time NULL) and ended ones retained for
-- reports.
CREATE TABLE lease.leases (
    id                uuid        PRIMARY KEY,
    client_id         text        NOT NULL,
    proxy_uid         text        NOT NULL,
    target_host       text        NOT NULL DEFAULT '',
    acquire_time      timestamptz NOT NULL,
    expire_time       timestamptz NOT NULL,
    -- active leases of the proxy right after this one was granted, counted
    -- under the proxy's row lock: an audit trail for capacity
    active_at_acquire integer     NOT NULL,
    -- max_leases in force when it was granted (0: unlimited)
    capacity          integer     NOT NULL,
    end_time          timestamptz,
    end_reason        text        CHECK (end_reason IN ('released', 'expired')),
    outcome           smallint,
    report_time       timestamptz,
    CHECK ((end_time IS NULL) = (end_reason IS NULL))
);

-- The expiry sweep reads active leases by expiry; the purge reads old
-- leases by acquisition (a lease ends after it starts, so every lease
-- ended before a time was acquired before it). Few indexes: every acquire
-- inserts a row and every release rewrites one.
CREATE INDEX leases_expiry ON lease.leases (expire_time) WHERE end_time IS NULL;
CREATE INDEX leases_acquired ON lease.leases (acquire_time);

-- cooldowns keep a proxy away from one target host, or from every target
-- (target_host ''), until expire_time.
CREATE TABLE lease.cooldowns (
    proxy_uid   text        NOT NULL,
    target_host text        NOT NULL,
    expire_time timestamptz NOT NULL,
    outcome     smallint    NOT NULL,
    PRIMARY KEY (proxy_uid, target_host)
);

CREATE INDEX cooldowns_expiry ON lease.cooldowns (expire_time);

-- +goose Down
DROP TABLE lease.cooldowns;
DROP TABLE lease.leases;
DROP TABLE lease.proxies;
