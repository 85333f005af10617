-- +goose Up
-- The change log a replica refreshes its view of the mirror from: every
-- write to proxies (snapshots, health, lease counts) or cooldowns logs
-- the uids of the proxies it touched under its transaction's id. A replica remembers the oldest transaction still
-- running when it last read (pg_snapshot_xmin), and next reads only the
-- proxies logged by that transaction or later ones: every transaction
-- older than it had finished, so the read saw its changes. The cost of a
-- refresh then follows the changes, not the size of the pool. The log is
-- a table of its own so that a lease's update of its proxy's row stays a
-- HOT update (no index on proxies covers a column it changes).
CREATE TABLE lease.proxy_changes (
    xid  xid8   NOT NULL DEFAULT pg_current_xact_id(),
    uids text[] NOT NULL
);
CREATE INDEX proxy_changes_xid ON lease.proxy_changes (xid);

-- +goose StatementBegin
CREATE FUNCTION lease.log_proxy_changes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease.proxy_changes (uids)
    SELECT array_agg(DISTINCT uid) FROM changed HAVING count(*) > 0;
    RETURN NULL;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION lease.log_cooldown_changes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease.proxy_changes (uids)
    SELECT array_agg(DISTINCT proxy_uid) FROM changed HAVING count(*) > 0;
    RETURN NULL;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION lease.log_proxy_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease.proxy_changes (uids) VALUES (ARRAY[NEW.uid]);
    RETURN NULL;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION lease.log_cooldown_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease.proxy_changes (uids) VALUES (ARRAY[NEW.proxy_uid]);
    RETURN NULL;
END $$;
-- +goose StatementEnd

-- A statement trigger runs even when its statement changed no row: a
-- resync's upsert of a proxy it already holds fires the INSERT and the
-- UPDATE statement triggers, some 15 us each on the benchmark machine
-- (a resync of 100,000 unchanged proxies). Statements that change many
-- rows at once (a round's acquires and releases, the sweep) get
-- statement triggers, one log row each; inserts, one row at a time and
-- rare (a new proxy, a cooldown), and the cooldowns' updates get row
-- triggers, which run only for a row actually written. A trigger with
-- transition tables takes one event.
CREATE TRIGGER proxies_inserted AFTER INSERT ON lease.proxies
    FOR EACH ROW EXECUTE FUNCTION lease.log_proxy_row();
CREATE TRIGGER proxies_updated AFTER UPDATE ON lease.proxies
    REFERENCING NEW TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION lease.log_proxy_changes();
CREATE TRIGGER proxies_deleted AFTER DELETE ON lease.proxies
    REFERENCING OLD TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION lease.log_proxy_changes();
CREATE TRIGGER cooldowns_inserted AFTER INSERT ON lease.cooldowns
    FOR EACH ROW EXECUTE FUNCTION lease.log_cooldown_row();
CREATE TRIGGER cooldowns_updated AFTER UPDATE ON lease.cooldowns
    FOR EACH ROW EXECUTE FUNCTION lease.log_cooldown_row();
CREATE TRIGGER cooldowns_deleted AFTER DELETE ON lease.cooldowns
    REFERENCING OLD TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION lease.log_cooldown_changes();

-- +goose Down
DROP TRIGGER cooldowns_deleted ON lease.cooldowns;
DROP TRIGGER cooldowns_updated ON lease.cooldowns;
DROP TRIGGER cooldowns_inserted ON lease.cooldowns;
DROP TRIGGER proxies_deleted ON lease.proxies;
DROP TRIGGER proxies_updated ON lease.proxies;
DROP TRIGGER proxies_inserted ON lease.proxies;
DROP FUNCTION lease.log_cooldown_row();
DROP FUNCTION lease.log_proxy_row();
DROP FUNCTION lease.log_cooldown_changes();
DROP FUNCTION lease.log_proxy_changes();
DROP TABLE lease.proxy_changes;
