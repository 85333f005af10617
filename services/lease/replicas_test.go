package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"

	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

// TestTwoReplicasNeverOverLease runs two lease service processes on one
// database and 200 concurrent acquirers spread over both (acquire → renew
// or report → release, some leases left to expire and be swept), then
// proves from the database that no proxy ever held more leases than its
// capacity: every lease records how many leases its proxy held right after
// it was granted (counted under the proxy's row lock), a sampler checks the
// live lease rows against capacity throughout the run, and the counters
// must equal the rows at the end.
func TestTwoReplicasNeverOverLease(t *testing.T) {
	t.Parallel()
	db := lt.Database(t)
	nsrv := natstest.New(t)
	tokenFile := lt.TokenFile(t)
	args := []string{
		"--database-url=" + db,
		"--database-max-conns=8",
		"--nats-url=" + nsrv.URL(),
		"--auth-token-file=" + tokenFile,
		"--default-max-leases=2",
		"--min-ttl=1s",
		"--sweep-interval=100ms",
	}
	var addrs [2]servicetest.Addrs
	for i := range addrs {
		_, addrs[i] = servicetest.Start(t, ".", args)
	}

	// The pool: 30 proxies with capacities 1 to 4 and the default (2),
	// published as the orchestrator does.
	capacity := map[string]int{}
	for i := range 30 {
		uid := fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
		p := lt.Proxy(uid, fmt.Sprintf("proxy-%02d", i))
		if i%5 == 4 {
			capacity[uid] = 2
		} else {
			capacity[uid] = i%4 + 1
			lt.MaxLeases(uint32(capacity[uid]))(p)
		}
		lt.PublishProxy(t, nsrv, "egress", proxyv1.ChangeType_CHANGE_TYPE_CREATED, p, int64(i+1))
	}
	total := 0
	for _, c := range capacity {
		total += c
	}

	conns := make([]*grpc.ClientConn, 2)
	for i := range conns {
		c, err := grpc.NewClient(addrs[i].GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithPerRPCCredentials(auth.BearerToken(lt.Tokens["crawler-a"])))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i] = c
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	waittest.For(t, 10*time.Second, "both replicas see the 30 proxies", func() bool {
		for _, c := range conns {
			resp, err := leasev1.NewLeaseServiceClient(c).ListProxies(ctx, &leasev1.ListProxiesRequest{})
			if err != nil || len(resp.GetProxies()) != 30 {
				return false
			}
		}
		return true
	})

	pool, err := pgxpool.New(ctx, db+"&pool_max_conns=2")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	// The sampler: live lease rows per proxy against capacity, from one
	// consistent snapshot each time.
	stop := make(chan struct{})
	var samples, violations atomic.Int64
	var firstViolation atomic.Value
	samplerDone := make(chan struct{})
	go func() {
		defer close(samplerDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			var uid string
			var n, c int
			err := pool.QueryRow(ctx, `
				SELECT l.proxy_uid, count(*), COALESCE(p.max_leases, 2)
				FROM lease.leases l JOIN lease.proxies p ON p.uid = l.proxy_uid
				WHERE l.end_time IS NULL
				GROUP BY l.proxy_uid, p.max_leases
				HAVING COALESCE(p.max_leases, 2) > 0 AND count(*) > COALESCE(p.max_leases, 2)
				LIMIT 1`).Scan(&uid, &n, &c)
			samples.Add(1)
			if err == nil {
				violations.Add(1)
				firstViolation.CompareAndSwap(nil, fmt.Sprintf("%s held %d leases, capacity %d", uid, n, c))
			}
		}
	}()

	const workers = 200
	const perWorker = 10
	var granted, exhausted, released, expiredLeft atomic.Int64
	var perReplica [2]atomic.Int64
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	targets := []string{"", "shop.example.com", "news.example.org"}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range perWorker {
				replica := (w + i) % 2
				c := leasev1.NewLeaseServiceClient(conns[replica])
				resp, err := c.AcquireLease(ctx, &leasev1.AcquireLeaseRequest{
					TargetHost: targets[rng.IntN(len(targets))],
					Ttl:        durationpb.New(time.Duration(1+rng.IntN(3)) * time.Second),
				})
				if status.Code(err) == codes.ResourceExhausted {
					exhausted.Add(1)
					continue
				}
				if err != nil {
					errs <- fmt.Errorf("acquire: %w", err)
					return
				}
				granted.Add(1)
				perReplica[replica].Add(1)
				id := resp.GetLease().GetLeaseId()
				// Use the lease on the other replica.
				other := leasev1.NewLeaseServiceClient(conns[1-replica])
				switch rng.IntN(10) {
				case 0:
					// Left to expire and be swept.
					expiredLeft.Add(1)
					continue
				case 1, 2:
					if _, err := other.RenewLease(ctx, &leasev1.RenewLeaseRequest{LeaseId: id, Ttl: durationpb.New(2 * time.Second)}); err != nil &&
						status.Code(err) != codes.NotFound {
						errs <- fmt.Errorf("renew: %w", err)
						return
					}
				case 3:
					if _, err := other.ReportOutcome(ctx, &leasev1.ReportOutcomeRequest{LeaseId: id,
						Outcome: leasev1.Outcome_OUTCOME_BLOCKED, Cooldown: durationpb.New(50 * time.Millisecond)}); err != nil {
						errs <- fmt.Errorf("report: %w", err)
						return
					}
				default:
					if _, err := other.ReportOutcome(ctx, &leasev1.ReportOutcomeRequest{LeaseId: id, Outcome: leasev1.Outcome_OUTCOME_SUCCESS}); err != nil {
						errs <- fmt.Errorf("report: %w", err)
						return
					}
				}
				if _, err := other.ReleaseLease(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: id}); err != nil {
					errs <- fmt.Errorf("release: %w", err)
					return
				}
				released.Add(1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Let the sweeps end the leases left to expire, still sampling.
	waittest.For(t, 15*time.Second, "every lease has ended", func() bool {
		var active int
		return pool.QueryRow(ctx, `SELECT count(*) FROM lease.leases WHERE end_time IS NULL`).Scan(&active) == nil && active == 0
	})
	close(stop)
	<-samplerDone

	t.Logf("granted %d (replica 0: %d, replica 1: %d), exhausted %d, released %d, left to expire %d; %d samples; total capacity %d",
		granted.Load(), perReplica[0].Load(), perReplica[1].Load(), exhausted.Load(), released.Load(), expiredLeft.Load(), samples.Load(), total)
	if violations.Load() > 0 {
		t.Errorf("the sampler saw %d capacity violations; first: %v", violations.Load(), firstViolation.Load())
	}
	if granted.Load() == 0 || exhausted.Load() == 0 || perReplica[0].Load() == 0 || perReplica[1].Load() == 0 {
		t.Errorf("the run did not contend: granted %d (per replica %d/%d), exhausted %d",
			granted.Load(), perReplica[0].Load(), perReplica[1].Load(), exhausted.Load())
	}
	if samples.Load() < 10 {
		t.Errorf("only %d samples", samples.Load())
	}

	// Every grant, across both replicas, was within capacity when made.
	var over int
	var detail string
	if err := pool.QueryRow(ctx, `
		SELECT count(*), COALESCE(max(proxy_uid || ' ' || active_at_acquire || '/' || capacity), '')
		FROM lease.leases WHERE capacity > 0 AND active_at_acquire > capacity`).Scan(&over, &detail); err != nil {
		t.Fatal(err)
	}
	if over > 0 {
		t.Errorf("%d leases were granted beyond capacity, e.g. %s", over, detail)
	}
	var rows, peaks int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE active_at_acquire = capacity) FROM lease.leases`).Scan(&rows, &peaks); err != nil {
		t.Fatal(err)
	}
	if int64(rows) != granted.Load() {
		t.Errorf("%d lease rows, %d grants", rows, granted.Load())
	}
	if peaks == 0 {
		t.Error("no proxy was ever filled to capacity: the test did not exercise the limit")
	}
	// The counters match the rows, and the capacities are those published.
	r, err := pool.Query(ctx, `
		SELECT p.uid, p.active_leases, COALESCE(p.max_leases, 2),
		       (SELECT count(*) FROM lease.leases l WHERE l.proxy_uid = p.uid AND l.end_time IS NULL)
		FROM lease.proxies p`)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for r.Next() {
		var uid string
		var counter, c, live int
		if err := r.Scan(&uid, &counter, &c, &live); err != nil {
			t.Fatal(err)
		}
		if counter != live || counter != 0 {
			t.Errorf("proxy %s: counter %d, live rows %d after the run", uid, counter, live)
		}
		if c != capacity[uid] {
			t.Errorf("proxy %s: capacity %d, published %d", uid, c, capacity[uid])
		}
	}
	// Both replicas counted their grants in their metrics.
	for i, a := range addrs {
		if n := grantedMetric(t, a.HTTP); n != float64(perReplica[i].Load()) {
			t.Errorf("replica %d reports %v grants, the clients saw %d", i, n, perReplica[i].Load())
		}
	}
}

var grantedRe = regexp.MustCompile(`(?m)^egress_lease_acquires_total\{result="granted"\} (\S+)$`)

func grantedMetric(t *testing.T, httpAddr string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := grantedRe.FindSubmatch(b)
	if m == nil {
		t.Fatalf("no granted counter in /metrics")
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// TestSessionsOnTwoReplicas runs two lease processes on one database:
// 8 sessions acquired 24 times each at once, half on each replica, get
// one lease per session; the database holds one active lease per session;
// and when a session's proxy is deleted, the next acquire on the other
// replica moves it and says why.
func TestSessionsOnTwoReplicas(t *testing.T) {
	t.Parallel()
	db := lt.Database(t)
	nsrv := natstest.New(t)
	args := []string{
		"--database-url=" + db,
		"--database-max-conns=4",
		"--nats-url=" + nsrv.URL(),
		"--auth-token-file=" + lt.TokenFile(t),
		"--default-max-leases=4",
	}
	var addrs [2]servicetest.Addrs
	for i := range addrs {
		_, addrs[i] = servicetest.Start(t, ".", args)
	}
	proxies := map[string]*proxyv1.Proxy{}
	for i := range 10 {
		p := lt.Proxy(fmt.Sprintf("00000000-0000-4000-8000-%012d", i), fmt.Sprintf("proxy-%02d", i))
		proxies[p.GetName()] = p
		lt.PublishProxy(t, nsrv, "egress", proxyv1.ChangeType_CHANGE_TYPE_CREATED, p, 1)
	}
	clients := make([]leasev1.LeaseServiceClient, 2)
	for i := range clients {
		c, err := grpc.NewClient(addrs[i].GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithPerRPCCredentials(auth.BearerToken(lt.Tokens["crawler-a"])))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		clients[i] = leasev1.NewLeaseServiceClient(c)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	waittest.For(t, 10*time.Second, "both replicas see the 10 proxies", func() bool {
		for _, c := range clients {
			resp, err := c.ListProxies(ctx, &leasev1.ListProxiesRequest{})
			if err != nil || len(resp.GetProxies()) != 10 {
				return false
			}
		}
		return true
	})

	const sessions, callers = 8, 24
	var mu sync.Mutex
	leases := map[string]map[string]bool{} // session → lease ids answered
	var wg sync.WaitGroup
	errs := make(chan error, sessions*callers)
	for s := range sessions {
		key := fmt.Sprintf("session-%d", s)
		leases[key] = map[string]bool{}
		for i := range callers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := clients[i%2].AcquireLease(ctx, &leasev1.AcquireLeaseRequest{
					TargetHost: "shop.example.com", SessionKey: key, Ttl: durationpb.New(time.Minute)})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				leases[key][resp.GetLease().GetLeaseId()] = true
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("session acquire: %v", err)
	}
	pool, err := pgxpool.New(ctx, db+"&pool_max_conns=2")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for key, ids := range leases {
		var active int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM lease.leases WHERE session_key = $1 AND end_reason IS NULL`, key).Scan(&active); err != nil {
			t.Fatal(err)
		}
		if len(ids) != 1 || active != 1 {
			t.Fatalf("%s: answered leases %v, %d active in the database; want one", key, ids, active)
		}
	}

	// Delete the proxy of session-0; the other replica moves it.
	first, err := clients[0].AcquireLease(ctx, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com", SessionKey: "session-0"})
	if err != nil {
		t.Fatal(err)
	}
	gone := proxies[first.GetLease().GetProxyName()]
	lt.PublishProxy(t, nsrv, "egress", proxyv1.ChangeType_CHANGE_TYPE_DELETED, gone, 2)
	waittest.For(t, 10*time.Second, "the deleted proxy leaves the listing", func() bool {
		resp, err := clients[1].ListProxies(ctx, &leasev1.ListProxiesRequest{})
		return err == nil && len(resp.GetProxies()) == 9
	})
	moved, err := clients[1].AcquireLease(ctx, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com", SessionKey: "session-0"})
	if err != nil {
		t.Fatal(err)
	}
	s := moved.GetSession()
	if s.GetResult() != leasev1.SessionResult_SESSION_RESULT_MOVED || s.GetMoveReason() != leasev1.SessionMoveReason_SESSION_MOVE_REASON_PROXY_DELETED ||
		s.GetPreviousLeaseId() != first.GetLease().GetLeaseId() || s.GetPreviousProxyName() != gone.GetName() ||
		moved.GetLease().GetProxyName() == gone.GetName() {
		t.Fatalf("acquire after deleting %s: %v, want MOVED off it for PROXY_DELETED", gone.GetName(), moved)
	}
	again, err := clients[0].AcquireLease(ctx, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com", SessionKey: "session-0"})
	if err != nil || again.GetLease().GetLeaseId() != moved.GetLease().GetLeaseId() ||
		again.GetSession().GetResult() != leasev1.SessionResult_SESSION_RESULT_EXISTING {
		t.Fatalf("acquire on the first replica after the move: %v, %v; want the moved session's lease", again, err)
	}
}
