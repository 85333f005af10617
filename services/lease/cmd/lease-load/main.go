// Command lease-load simulates a crawler fleet against a running lease
// service: it publishes a pool of Ready, healthy proxies as ProxyEvents on
// NATS (as the orchestrator would), waits until the service lists them,
// then runs concurrent clients that loop acquire → report → release
// through gRPC or REST for a fixed time. It prints throughput (completed
// acquire+release pairs per second), p50/p99/max latency of each call and
// of the whole loop, and the capacity violations it can detect: a proxy
// held by more clients at once than its capacity (seen by the clients),
// and, with --database-url, leases the database granted beyond capacity.
//
//	lease-load --grpc-addr 127.0.0.1:8110 --token-file tokens --nats-url nats://127.0.0.1:4222 \
//	    --proxies 1000 --clients 200 --duration 30s --transport grpc
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/procfs"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
)

type config struct {
	grpcAddr, httpAddr, transport string
	tokenFile                     string
	natsURL, natsPrefix           string
	databaseURL                   string
	proxies, clients, maxLeases   int
	targets, conns                int
	rate                          float64
	duration, warmup              time.Duration
	seed                          bool
	readyTimeout                  time.Duration
	// readyIn is how long the service took to list every proxy after
	// the pool was published.
	readyIn time.Duration
}

func main() {
	var c config
	fs := flag.NewFlagSet("lease-load", flag.ExitOnError)
	fs.StringVar(&c.grpcAddr, "grpc-addr", "127.0.0.1:8110", "lease service gRPC address")
	fs.StringVar(&c.httpAddr, "http-addr", "127.0.0.1:8111", "lease service HTTP (REST) address")
	fs.StringVar(&c.transport, "transport", "grpc", "grpc or rest")
	fs.StringVar(&c.tokenFile, "token-file", "", "file whose first `<client-id> <token>` line is used; empty: no token")
	fs.StringVar(&c.natsURL, "nats-url", "nats://127.0.0.1:4222", "NATS URL, to publish the pool")
	fs.StringVar(&c.natsPrefix, "nats-prefix", bus.DefaultPrefix, "NATS prefix of the lease service")
	fs.StringVar(&c.databaseURL, "database-url", "", "the lease service's database, to check capacity from the lease rows afterwards (optional)")
	fs.IntVar(&c.proxies, "proxies", 1000, "proxies in the pool")
	fs.IntVar(&c.clients, "clients", 200, "concurrent clients")
	fs.IntVar(&c.maxLeases, "max-leases", 1, "capacity of each proxy (spec.lease.max_leases)")
	fs.IntVar(&c.targets, "targets", 50, "distinct target hosts the clients fetch")
	fs.IntVar(&c.conns, "conns", 1, "gRPC connections the clients share (round robin)")
	fs.Float64Var(&c.rate, "rate", 0,
		"loops per second for all clients together, evenly paced; 0: every client starts its next loop at once (closed loop, the most the service sustains)")
	fs.DurationVar(&c.duration, "duration", 30*time.Second, "measured run time")
	fs.DurationVar(&c.readyTimeout, "ready-timeout", time.Minute, "how long the service may take to list every proxy published")
	fs.DurationVar(&c.warmup, "warmup", 3*time.Second, "unmeasured run time before it")
	fs.BoolVar(&c.seed, "seed", true, "publish the pool before the run")
	_ = fs.Parse(os.Args[1:])
	if err := run(c); err != nil {
		fmt.Fprintln(os.Stderr, "lease-load:", err)
		os.Exit(1)
	}
}

// client is one transport.
type client interface {
	acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*leasev1.Lease, error)
	report(ctx context.Context, req *leasev1.ReportOutcomeRequest) error
	release(ctx context.Context, id string) error
	list(ctx context.Context) (int, error)
}

func run(c config) error {
	ctx := context.Background()
	token := ""
	if c.tokenFile != "" {
		b, err := os.ReadFile(c.tokenFile)
		if err != nil {
			return err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && !strings.HasPrefix(f[0], "#") {
				token = f[1]
				break
			}
		}
	}
	var cl client
	switch c.transport {
	case "grpc":
		// Fixed windows, as docs/lease.md advises crawler clients: no
		// bandwidth-probing pings.
		opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithInitialWindowSize(1 << 20), grpc.WithInitialConnWindowSize(1 << 20)}
		if token != "" {
			opts = append(opts, grpc.WithPerRPCCredentials(auth.BearerToken(token)))
		}
		g := &grpcClient{}
		for range max(c.conns, 1) {
			conn, err := grpc.NewClient(c.grpcAddr, opts...)
			if err != nil {
				return err
			}
			defer conn.Close()
			g.c = append(g.c, leasev1.NewLeaseServiceClient(conn))
		}
		cl = g
	case "rest":
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConns = c.clients * 2
		tr.MaxIdleConnsPerHost = c.clients * 2
		cl = &restClient{base: "http://" + c.httpAddr, token: token, hc: &http.Client{Transport: tr}}
	default:
		return fmt.Errorf("--transport %q: want grpc or rest", c.transport)
	}

	uids := make([]string, c.proxies)
	for i := range uids {
		uids[i] = fmt.Sprintf("10ad0000-0000-4000-8000-%012d", i)
	}
	published := time.Now()
	if c.seed {
		if err := seed(ctx, c, uids); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(c.readyTimeout)
	// Each poll lists the whole pool: a large one is polled less often,
	// so that the polling does not load what it waits for.
	poll := 200 * time.Millisecond
	if c.proxies > 10000 {
		poll = 2 * time.Second
	}
	for {
		n, err := cl.list(ctx)
		if err == nil && n >= c.proxies {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the service lists %d proxies after %s, want %d (last error: %v)", n, c.readyTimeout, c.proxies, err)
		}
		time.Sleep(poll) // polling interval
	}
	c.readyIn = time.Since(published)

	targets := make([]string, c.targets)
	for i := range targets {
		targets[i] = fmt.Sprintf("site-%03d.example.com", i)
	}
	holders := make(map[string]*atomic.Int32, len(uids))
	for _, u := range uids {
		holders[u] = &atomic.Int32{}
	}
	var (
		measuring   atomic.Bool
		stop        atomic.Bool
		pairs       atomic.Int64
		exhausted   atomic.Int64
		errorsN     atomic.Int64
		violations  atomic.Int64
		firstErr    atomic.Value
		mu          sync.Mutex
		latAcquire  []time.Duration
		latReport   []time.Duration
		latRelease  []time.Duration
		latLoop     []time.Duration
		wg          sync.WaitGroup
		unknownUIDs atomic.Int64
		late        atomic.Int64
	)
	// With --rate each client starts a loop every clients/rate seconds,
	// the clients spread evenly over that period; a loop that could not
	// start on time counts as late (the service fell behind the rate).
	var interval time.Duration
	if c.rate > 0 {
		interval = time.Duration(float64(c.clients) / c.rate * float64(time.Second))
	}
	begin := time.Now()
	for w := range c.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			var la, lr, lrel, ll []time.Duration
			defer func() {
				mu.Lock()
				latAcquire = append(latAcquire, la...)
				latReport = append(latReport, lr...)
				latRelease = append(latRelease, lrel...)
				latLoop = append(latLoop, ll...)
				mu.Unlock()
			}()
			fail := func(err error) {
				errorsN.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
			}
			next := begin.Add(interval * time.Duration(w) / time.Duration(c.clients))
			for !stop.Load() {
				if interval > 0 {
					if wait := time.Until(next); wait > 0 {
						time.Sleep(wait) // pacing to --rate
					} else if -wait > interval && measuring.Load() {
						late.Add(1)
					}
					next = next.Add(interval)
				}
				m := measuring.Load()
				t0 := time.Now()
				lease, err := cl.acquire(ctx, &leasev1.AcquireLeaseRequest{
					TargetHost: targets[rng.IntN(len(targets))],
					Ttl:        durationpb.New(time.Minute),
				})
				t1 := time.Now()
				if status.Code(err) == codes.ResourceExhausted {
					exhausted.Add(1)
					continue
				}
				if err != nil {
					fail(err)
					continue
				}
				h := holders[lease.GetProxyUid()]
				if h == nil {
					unknownUIDs.Add(1)
					h = &atomic.Int32{}
				}
				if n := h.Add(1); c.maxLeases > 0 && int(n) > c.maxLeases {
					violations.Add(1)
				}
				outcome := leasev1.Outcome_OUTCOME_SUCCESS
				var cooldown *durationpb.Duration
				if rng.IntN(50) == 0 {
					outcome = leasev1.Outcome_OUTCOME_BLOCKED
					cooldown = durationpb.New(2 * time.Second)
				}
				err = cl.report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: lease.GetLeaseId(), Outcome: outcome, Cooldown: cooldown})
				t2 := time.Now()
				if err != nil {
					fail(err)
				}
				h.Add(-1)
				err = cl.release(ctx, lease.GetLeaseId())
				t3 := time.Now()
				if err != nil {
					fail(err)
					continue
				}
				if m && measuring.Load() {
					pairs.Add(1)
					la = append(la, t1.Sub(t0))
					lr = append(lr, t2.Sub(t1))
					lrel = append(lrel, t3.Sub(t2))
					ll = append(ll, t3.Sub(t0))
				}
			}
		}()
	}
	time.Sleep(c.warmup) // the warm-up is a length of run, not synchronisation
	var startExhausted = exhausted.Load()
	machineBefore := readMachine()
	measuring.Store(true)
	start := time.Now()
	time.Sleep(c.duration)
	measuring.Store(false)
	elapsed := time.Since(start)
	machine := machineDelta(machineBefore, readMachine())
	exhaustedMeasured := exhausted.Load() - startExhausted
	stop.Store(true)
	wg.Wait()

	dbOver := int64(-1)
	if c.databaseURL != "" {
		conn, err := pgx.Connect(ctx, c.databaseURL)
		if err != nil {
			return err
		}
		err = conn.QueryRow(ctx, `SELECT count(*) FROM lease.leases WHERE capacity > 0 AND active_at_acquire > capacity`).Scan(&dbOver)
		conn.Close(ctx)
		if err != nil {
			return err
		}
	}
	res := map[string]any{
		"transport":               c.transport,
		"proxies":                 c.proxies,
		"clients":                 c.clients,
		"conns":                   c.conns,
		"rate":                    c.rate,
		"late_loops":              late.Load(),
		"max_leases":              c.maxLeases,
		"duration_s":              elapsed.Seconds(),
		"pairs":                   pairs.Load(),
		"pairs_per_s":             float64(pairs.Load()) / elapsed.Seconds(),
		"exhausted":               exhaustedMeasured,
		"errors":                  errorsN.Load(),
		"client_seen_violations":  violations.Load(),
		"db_leases_over_capacity": dbOver,
		"acquire_ms":              pct(latAcquire),
		"report_ms":               pct(latReport),
		"release_ms":              pct(latRelease),
		"pool_listed_s":           c.readyIn.Seconds(),
		"loop_ms":                 pct(latLoop),
	}
	if machine != nil {
		res["machine"] = machine
	}
	if v := firstErr.Load(); v != nil {
		res["first_error"] = v
	}
	if unknownUIDs.Load() > 0 {
		res["leases_on_other_proxies"] = unknownUIDs.Load()
	}
	out, _ := json.MarshalIndent(res, "", "  ")
	fmt.Println(string(out))
	if violations.Load() > 0 || dbOver > 0 {
		return fmt.Errorf("capacity violations: %d seen by clients, %d in the database", violations.Load(), dbOver)
	}
	return nil
}

func pct(d []time.Duration) map[string]float64 {
	if len(d) == 0 {
		return nil
	}
	slices.Sort(d)
	at := func(q float64) float64 {
		return float64(d[min(len(d)-1, int(q*float64(len(d))))].Microseconds()) / 1000
	}
	return map[string]float64{"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": float64(d[len(d)-1].Microseconds()) / 1000}
}

// readMachine reads the machine's CPU and process counters; nil where
// /proc is not there.
func readMachine() *procfs.Stat {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return nil
	}
	st, err := fs.Stat()
	if err != nil {
		return nil
	}
	return &st
}

// machineDelta is what the machine did during the measured run: how busy
// its CPUs were (everything on it, this command and the service included)
// and how many processes were started. Both explain a tail: on a small
// virtual machine a burst of process starts (an autovacuum worker, a
// cron job, a monitoring script) stalls every process for milliseconds.
func machineDelta(a, b *procfs.Stat) map[string]float64 {
	if a == nil || b == nil {
		return nil
	}
	total := func(c procfs.CPUStat) float64 {
		return c.User + c.Nice + c.System + c.Idle + c.Iowait + c.IRQ + c.SoftIRQ + c.Steal
	}
	all := total(b.CPUTotal) - total(a.CPUTotal)
	if all <= 0 {
		return nil
	}
	idle := b.CPUTotal.Idle + b.CPUTotal.Iowait - a.CPUTotal.Idle - a.CPUTotal.Iowait
	steal := b.CPUTotal.Steal - a.CPUTotal.Steal
	return map[string]float64{
		"cpu_busy_pct":      100 * (all - idle - steal) / all,
		"cpu_steal_pct":     100 * steal / all,
		"processes_started": float64(b.ProcessCreated - a.ProcessCreated),
	}
}

// seed publishes the pool as ProxyEvents, with revisions above any the
// stream holds for these proxies.
func seed(ctx context.Context, c config, uids []string) error {
	nc, err := nats.Connect(c.natsURL, nats.Name("lease-load"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	names := bus.Names{Prefix: c.natsPrefix}
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		return err
	}
	base := time.Now().UnixNano()
	healthTime := timestamppb.New(time.Now().Add(-time.Minute))
	for i, uid := range uids {
		p := &proxyv1.Proxy{
			Uid:    uid,
			Name:   fmt.Sprintf("load-%05d", i),
			Labels: map[string]string{"pool": "load"},
			Spec: &proxyv1.ProxySpec{
				Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "load",
				Placement: &proxyv1.Placement{Region: "r1", Zone: "z1"},
				Lease:     &proxyv1.LeaseSpec{MaxLeases: proto.Uint32(uint32(c.maxLeases))},
			},
			Status: &proxyv1.ProxyStatus{
				Phase: proxyv1.ProxyPhase_PROXY_PHASE_READY, Healthy: true, HealthTransitionTime: healthTime,
				ProviderId: "load/" + uid, Ip: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), Port: 3128,
			},
		}
		ev := &busv1.ProxyEvent{Revision: base + int64(i), Type: proxyv1.ChangeType_CHANGE_TYPE_CREATED, Proxy: p, ChangeTime: timestamppb.Now()}
		if _, err := bus.Publish(ctx, js, names.ProxyEventSubject(uid), ev); err != nil {
			return fmt.Errorf("publishing the pool: %w", err)
		}
	}
	return nil
}

// grpcClient spreads calls over its connections, round robin.
type grpcClient struct {
	c    []leasev1.LeaseServiceClient
	next atomic.Uint32
}

func (g *grpcClient) conn() leasev1.LeaseServiceClient {
	return g.c[int(g.next.Add(1))%len(g.c)]
}

func (g *grpcClient) acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*leasev1.Lease, error) {
	r, err := g.conn().AcquireLease(ctx, req)
	return r.GetLease(), err
}

func (g *grpcClient) report(ctx context.Context, req *leasev1.ReportOutcomeRequest) error {
	_, err := g.conn().ReportOutcome(ctx, req)
	return err
}

func (g *grpcClient) release(ctx context.Context, id string) error {
	_, err := g.conn().ReleaseLease(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: id})
	return err
}

// listPageSize is the most a page of ListProxies holds: far below gRPC's
// 4 MiB a message.
const listPageSize = 1000

func (g *grpcClient) list(ctx context.Context) (int, error) {
	n, token := 0, ""
	for {
		r, err := g.conn().ListProxies(ctx, &leasev1.ListProxiesRequest{
			Selector: &leasev1.ProxySelector{Labels: map[string]string{"pool": "load"}}, PageSize: listPageSize, PageToken: token})
		if err != nil {
			return n, err
		}
		n += len(r.GetProxies())
		if token = r.GetNextPageToken(); token == "" {
			return n, nil
		}
	}
}

type restClient struct {
	base, token string
	hc          *http.Client
}

func (r *restClient) do(ctx context.Context, method, path string, body, out proto.Message) error {
	var data []byte
	if body != nil {
		var err error
		if data, err = protojson.Marshal(body); err != nil {
			return err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, r.base+path, bytes.NewReader(data))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if r.token != "" {
		req.Header.Set("Authorization", "Bearer "+r.token)
	}
	resp, err := r.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return protojson.Unmarshal(b, out)
	case http.StatusConflict:
		return status.Error(codes.ResourceExhausted, "no proxy available")
	default:
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, b)
	}
}

func (r *restClient) acquire(ctx context.Context, req *leasev1.AcquireLeaseRequest) (*leasev1.Lease, error) {
	out := &leasev1.AcquireLeaseResponse{}
	err := r.do(ctx, http.MethodPost, "/v1/leases", req, out)
	return out.GetLease(), err
}

func (r *restClient) report(ctx context.Context, req *leasev1.ReportOutcomeRequest) error {
	body := proto.Clone(req).(*leasev1.ReportOutcomeRequest)
	body.LeaseId = ""
	return r.do(ctx, http.MethodPost, "/v1/leases/"+req.GetLeaseId()+":report", body, &leasev1.ReportOutcomeResponse{})
}

func (r *restClient) release(ctx context.Context, id string) error {
	return r.do(ctx, http.MethodPost, "/v1/leases/"+id+":release", &leasev1.ReleaseLeaseRequest{}, &leasev1.ReleaseLeaseResponse{})
}

func (r *restClient) list(ctx context.Context) (int, error) {
	n, token := 0, ""
	for {
		out := &leasev1.ListProxiesResponse{}
		q := url.Values{"selector.labels[pool]": {"load"}, "page_size": {strconv.Itoa(listPageSize)}}
		if token != "" {
			q.Set("page_token", token)
		}
		if err := r.do(ctx, http.MethodGet, "/v1/leasable-proxies?"+q.Encode(), nil, out); err != nil {
			return n, err
		}
		n += len(out.GetProxies())
		if token = out.GetNextPageToken(); token == "" {
			return n, nil
		}
	}
}
