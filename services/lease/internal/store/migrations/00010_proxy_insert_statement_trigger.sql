-- +goose Up

-- A new proxy was logged by a row trigger, one log row and one trigger
-- call for each inserted proxy: a resync into an empty mirror inserts its
-- 1,000-proxy pages one statement each, and paid 1,000 trigger calls a
-- page. Snapshots are now written a page or a batch of events per
-- statement, so inserts log like the other statements that change many
-- rows: one log row per statement (none when it inserted nothing).
DROP TRIGGER proxies_inserted ON lease.proxies;
CREATE TRIGGER proxies_inserted AFTER INSERT ON lease.proxies
    REFERENCING NEW TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION lease.log_proxy_changes();

-- +goose Down
DROP TRIGGER proxies_inserted ON lease.proxies;
CREATE TRIGGER proxies_inserted AFTER INSERT ON lease.proxies
    FOR EACH ROW EXECUTE FUNCTION lease.log_proxy_row();
