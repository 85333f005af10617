package store

import (
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A session is a client's lease under a key: the unique index
// leases_session allows one active lease per client and key. A round's
// session acquires first run sessionSQL, which keeps each session's lease
// when its proxy can still serve the request, or ends it; acquireSQL then
// grants a new lease only to the sessions left without one. Both run in
// the round's transaction, after lockSQL has locked the proxies of the
// sessions' leases with the round's others, in uid order.
//
// Two replicas may start the same session at once: both find no lease,
// and the second insert waits for the first's commit and then violates
// the unique index. That round is retried whole, and its sessionSQL then
// finds the first replica's lease (sessionTaken).

// verdictExpired is sessionSQL's verdict on a session lease past its
// expiry that the sweep has not ended yet: the session ended, and the
// acquire starts a new one. The other non-empty verdicts are MoveReasons.
const verdictExpired = "expired"

// sessionSQL decides, for every session acquire of a round, what becomes
// of the session's active lease: kept (verdict ”, expiry moved to at
// least the requested one) when its proxy is leasable, matches the
// selector and cools down neither for the target nor globally; otherwise
// ended, as expired past its expiry or as moved, giving its capacity back.
// The verdicts are tried in the order of store.MoveReason's constants.
// A session without an active lease whose latest lease ended as moved (in
// a round that found no proxy to take it) is answered too, marked
// earlier, with that move's reason as its verdict: the grant to come
// completes the move.
const sessionSQL = `
WITH req AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[],
	                     $5::text[], $6::text[], $7::text[], $8::text[], $9::jsonb[])
		AS r(client_id, session_key, target_host, expire_time, provider, region, zone, pool, labels)
), cur AS (
	SELECT le.id, r.client_id, r.session_key, r.expire_time AS want, p.uid, p.name, p.host, p.port, p.pool,
	       CASE
	         WHEN le.expire_time <= $10 THEN 'expired'
	         WHEN p.deleted THEN 'deleted'
	         WHEN p.draining THEN 'draining'
	         WHEN NOT p.leasable THEN 'unhealthy'
	         WHEN (r.provider <> '' AND p.provider <> r.provider) OR (r.region <> '' AND p.region <> r.region)
	           OR (r.zone <> '' AND p.zone <> r.zone) OR (r.pool <> '' AND p.pool <> r.pool)
	           OR NOT p.labels @> r.labels THEN 'selector'
	         WHEN COALESCE((SELECT bool_or(c.expire_time > $10) FROM lease.cooldowns c
	                        WHERE c.proxy_uid = p.uid AND c.target_host IN ('', r.target_host)), false) THEN 'cooling_down'
	         ELSE ''
	       END AS verdict
	FROM req r
	JOIN lease.leases le ON le.client_id = r.client_id AND le.session_key = r.session_key
	     AND le.session_key <> '' AND le.end_reason IS NULL
	JOIN lease.proxies p ON p.uid = le.proxy_uid
), kept AS (
	UPDATE lease.leases le SET expire_time = GREATEST(le.expire_time, c.want)
	FROM cur c WHERE le.id = c.id AND c.verdict = ''
	RETURNING le.id, le.target_host, le.acquire_time, le.expire_time
), ended AS (
	UPDATE lease.leases le
	SET end_time = LEAST($10, le.expire_time),
	    end_reason = CASE WHEN c.verdict = 'expired' THEN 'expired' ELSE 'moved' END,
	    move_reason = CASE WHEN c.verdict = 'expired' THEN '' ELSE c.verdict END
	FROM cur c WHERE le.id = c.id AND c.verdict <> ''
	RETURNING le.id, le.proxy_uid
), latest AS (
	SELECT DISTINCT ON (r.client_id, r.session_key) r.client_id, r.session_key, le.id, le.proxy_uid,
	       le.end_reason, le.move_reason
	FROM req r
	JOIN lease.leases le ON le.client_id = r.client_id AND le.session_key = r.session_key AND le.session_key <> ''
	WHERE NOT EXISTS (SELECT 1 FROM cur c WHERE c.client_id = r.client_id AND c.session_key = r.session_key)
	ORDER BY r.client_id, r.session_key, le.acquire_time DESC
), n AS (
	SELECT proxy_uid, count(*)::int AS n FROM ended GROUP BY proxy_uid
), p AS (
	UPDATE lease.proxies p SET active_leases = p.active_leases - n.n
	FROM n WHERE p.uid = n.proxy_uid
	RETURNING p.uid, p.active_leases
)
SELECT c.client_id, c.session_key, c.id::text, c.uid, c.name, c.host, c.port, c.pool, c.verdict,
       COALESCE(k.target_host, ''), k.acquire_time, k.expire_time, COALESCE(p.active_leases, -1), false
FROM cur c LEFT JOIN kept k ON k.id = c.id LEFT JOIN p ON p.uid = c.uid
UNION ALL
SELECT l.client_id, l.session_key, l.id::text, l.proxy_uid, px.name, '', 0, '', l.move_reason,
       '', NULL, NULL, -1, true
FROM latest l JOIN lease.proxies px ON px.uid = l.proxy_uid
WHERE l.end_reason = 'moved' AND l.move_reason <> ''`

// sessionRow is sessionSQL's answer for one session that had an active
// lease: the lease (complete when kept), the verdict, and its proxy's
// active leases after the round when the lease ended (-1 otherwise). An
// earlier row is the session's latest lease, moved in an earlier round
// (its id, proxy and the move's reason as the verdict).
type sessionRow struct {
	lease   Lease
	verdict string
	active  int
	earlier bool
}

// sessionArgs are sessionSQL's arrays, one entry per session acquire.
type sessionArgs struct {
	clients, keys, targets    []string
	expire                    []time.Time
	providers, regions, zones []string
	pools, labels             []string
}

func (a *sessionArgs) add(o *op, now time.Time) {
	sel := o.acquire.Selector
	a.clients = append(a.clients, o.acquire.ClientID)
	a.keys = append(a.keys, o.acquire.SessionKey)
	a.targets = append(a.targets, o.acquire.TargetHost)
	a.expire = append(a.expire, now.Add(o.acquire.TTL))
	a.providers = append(a.providers, sel.Provider)
	a.regions = append(a.regions, sel.Region)
	a.zones = append(a.zones, sel.Zone)
	a.pools = append(a.pools, sel.Pool)
	a.labels = append(a.labels, sel.labelsJSON())
}

// queue adds sessionSQL to the round's batch; its rows go to out, by
// op.session().
func (a *sessionArgs) queue(b *pgx.Batch, now time.Time, out map[string]sessionRow) {
	b.Queue(sessionSQL, a.clients, a.keys, a.targets, a.expire, a.providers, a.regions, a.zones, a.pools, a.labels, now).
		Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var r sessionRow
				var client, key string
				var port int32
				var acquired, expire *time.Time
				if err := rows.Scan(&client, &key, &r.lease.ID, &r.lease.ProxyUID, &r.lease.ProxyName, &r.lease.Host, &port,
					&r.lease.Pool, &r.verdict, &r.lease.TargetHost, &acquired, &expire, &r.active, &r.earlier); err != nil {
					return err
				}
				r.lease.ClientID, r.lease.SessionKey, r.lease.Port = client, key, uint32(port)
				if acquired != nil {
					r.lease.AcquireTime, r.lease.ExpireTime = *acquired, *expire
				}
				out[client+"\x00"+key] = r
			}
			return rows.Err()
		})
}

// sessionTaken reports whether err is another replica's session lease
// committed first (the unique index leases_session): the round is tried
// again and then finds that lease.
func sessionTaken(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "leases_session"
}
