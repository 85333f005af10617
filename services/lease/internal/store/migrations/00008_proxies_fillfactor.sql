-- +goose Up
-- Every lease updates its proxy's row twice (acquire, release). The update
-- is a HOT update, with no index entry written, only when the row's page
-- has room for the new version; rows loaded into full pages (a pool
-- published at once) have none until a vacuum, so in a large pool, where
-- the selection order (least recently leased first) reaches a proxy
-- rarely, most first leases moved their row to another page and wrote an
-- index entry for it. Half of each page is left free for the updates.
ALTER TABLE lease.proxies SET (fillfactor = 50);

-- +goose Down
ALTER TABLE lease.proxies RESET (fillfactor);
