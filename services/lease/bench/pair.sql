-- The lease service's own statements for one acquire → report → release
-- loop, for pgbench: PostgreSQL's limit for exactly this work, without the
-- service. Mirrors internal/store (default capacity 1, no selector).
\set t random(0, 49)
WITH pick AS (SELECT p.uid FROM lease.proxies p WHERE p.leasable AND ('' = '' OR p.provider = '') AND ('' = '' OR p.region = '') AND ('' = '' OR p.zone = '') AND p.labels @> '{}'::jsonb AND (COALESCE(p.max_leases, 1) = 0 OR p.active_leases < COALESCE(p.max_leases, 1)) AND NOT EXISTS (SELECT 1 FROM lease.cooldowns c WHERE c.proxy_uid = p.uid AND c.target_host IN ('', 'site-' || :t || '.example.com') AND c.expire_time > now()) ORDER BY p.active_leases, p.last_lease_time NULLS FIRST, p.tiebreak LIMIT 1 FOR UPDATE OF p SKIP LOCKED), upd AS (UPDATE lease.proxies p SET active_leases = p.active_leases + 1, last_lease_time = clock_timestamp() FROM pick WHERE p.uid = pick.uid AND (COALESCE(p.max_leases, 1) = 0 OR p.active_leases < COALESCE(p.max_leases, 1)) RETURNING p.uid, p.name, p.host, p.port, p.active_leases, COALESCE(p.max_leases, 1) AS capacity), ins AS (INSERT INTO lease.leases (id, client_id, proxy_uid, target_host, acquire_time, expire_time, active_at_acquire, capacity) SELECT gen_random_uuid(), 'pgbench', upd.uid, 'site-' || :t || '.example.com', now(), now() + interval '1 minute', upd.active_leases, upd.capacity FROM upd RETURNING id, proxy_uid) SELECT ins.id::text AS id FROM ins \gset
BEGIN;
SELECT set_config('synchronous_commit', 'off', true);
WITH l AS (UPDATE lease.leases SET outcome = 1, report_time = now() WHERE id = :id::uuid AND client_id = 'pgbench' RETURNING proxy_uid, target_host) SELECT l.proxy_uid FROM l;
COMMIT;
BEGIN;
SELECT set_config('synchronous_commit', 'off', true);
WITH l AS (UPDATE lease.leases SET end_time = LEAST(now(), expire_time), end_reason = CASE WHEN expire_time > now() THEN 'released' ELSE 'expired' END WHERE id = :id::uuid AND client_id = 'pgbench' AND end_time IS NULL RETURNING proxy_uid, end_reason = 'released' AS active), p AS (UPDATE lease.proxies p SET active_leases = p.active_leases - 1 FROM l WHERE p.uid = l.proxy_uid RETURNING 1) SELECT l.active FROM l, p;
COMMIT;
