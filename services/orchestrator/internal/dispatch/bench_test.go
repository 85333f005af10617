package dispatch_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync"
	"github.com/egress-proxies/egress-proxies/pkg/proxysync/proxysynctest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// BenchmarkConverge creates N proxies through the gRPC API (32 concurrent
// clients) against a provisioner that answers every command at once, and
// measures the time until every proxy is Running. Run it once per size:
//
//	go test -run '^$' -bench BenchmarkConverge -benchtime 1x ./services/orchestrator/internal/dispatch/
//
// It reports proxies/s (converged) and the create phase's own rate, and
// the CPU the converge took a proxy: the test process's (cpu-us/proxy:
// the replica and API, the in-process NATS server and the answering
// provisioner) and, when PostgreSQL runs on this machine, that of the
// benchmark database's backends (db-cpu-us/proxy, from /proc).
// BENCH_CONVERGE_SIZES overrides the sizes ("10000 100000", as make
// bench-scale runs it); BENCH_STEADY_SECONDS=S adds, once every proxy
// runs, S seconds with nothing changing and reports the process's CPU in
// them as a share of one core (steady-cpu-%: the orchestrator's replica
// and API, with the in-process NATS server and the answering provisioner,
// which are idle then). Then it lists every proxy through the API as a
// resync does (pkg/proxysync, pages of 1,000) and reports how long that
// took (s-to-list-all). Last a simulated health publisher sends one
// healthy verdict per listed proxy's instance, as the health service
// publishes them (orchtest.PublishVerdicts) but without waiting on each,
// and it reports the time until the store has every proxy Ready
// (s-to-ready, ready/s; verdicts/s is the publisher's own rate).
// heap-B/proxy is the growth of the process's live Go heap over the
// converge, per proxy, and rss-B/proxy the process's resident set at the
// end (VmRSS) per proxy: upper bounds on the orchestrator's share.
//
// Throughout, one client follows the proxies through WatchProxies from
// before the first create (BENCH_CONVERGE_WATCH=off leaves it out, to see
// what it costs the converge): s-watch-running is the time from the first
// create until it has seen every proxy Running, watch-lag-s how long after
// the store had them all, s-watch-ready and watch-ready-lag-s the same for
// Ready, watch-events the changes it received.
func BenchmarkConverge(b *testing.B) {
	sizes := []int{1000, 10000}
	if env := os.Getenv("BENCH_CONVERGE_SIZES"); env != "" {
		sizes = sizes[:0]
		for _, f := range strings.Fields(env) {
			n, err := strconv.Atoi(f)
			if err != nil || n <= 0 {
				b.Fatalf("BENCH_CONVERGE_SIZES: %q is not a positive count", f)
			}
			sizes = append(sizes, n)
		}
	}
	for _, n := range sizes {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			for range b.N {
				converge(b, n)
			}
		})
	}
}

func converge(b *testing.B, n int) {
	h := orchtest.New(b)
	if os.Getenv("BENCH_ASYNC_COMMIT") != "" {
		_, _ = h.Store.Pool().Exec(context.Background(), "ALTER DATABASE "+strings.TrimPrefix(must(url.Parse(h.DSN)).Path, "/")+" SET synchronous_commit = off")
	}
	// The backend: the answering Cloud in this process, or with
	// BENCH_CONVERGE_BACKEND=sim the fleet simulator's provisioner and farm
	// as processes of their own (services/provisioner-sim), every proxy a
	// real loopback proxy on the farm's shared port.
	port := uint32(0)
	if os.Getenv("BENCH_CONVERGE_BACKEND") == "sim" {
		port = startSim(b, h)
	} else {
		h.StartCloud("fake")
	}
	h.StartReplica()

	srv := grpc.NewServer()
	proxyv1.RegisterProxyServiceServer(srv, h.API)
	client := proxyv1.NewProxyServiceClient(grpctest.Dial(b, grpctest.Serve(b, srv)))
	ctx := context.Background()

	var w *watcher
	if os.Getenv("BENCH_CONVERGE_WATCH") != "off" {
		w = watch(b, client, n)
	}
	heapBefore := proxysynctest.HeapInUse()
	cpuBefore, dbBefore := cpuTime(), dbCPU(b, h)
	b.ResetTimer()
	start := time.Now()
	w.from(start)
	names := make(chan string)
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range names {
				req := orchtest.Managed(name)
				if port != 0 {
					req.Spec.Port = port
				}
				if _, err := client.CreateProxy(ctx, req); err != nil {
					b.Error(err)
				}
			}
		}()
	}
	for i := range n {
		names <- fmt.Sprintf("bench-%06d", i)
	}
	close(names)
	wg.Wait()
	created := time.Since(start)

	waitPhase(b, h, n, proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, 10*time.Minute-time.Since(start))
	total := time.Since(start)
	b.StopTimer()
	cpuUsed, dbUsed := cpuTime()-cpuBefore, dbCPU(b, h)
	w.report(b, proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, total, "s-watch-running", "watch-lag-s")
	b.ReportMetric(float64(n)/total.Seconds(), "proxies/s")
	b.ReportMetric(float64(n)/created.Seconds(), "creates/s")
	b.ReportMetric(total.Seconds(), "s-to-converge")
	b.ReportMetric(float64(cpuUsed.Microseconds())/float64(n), "cpu-us/proxy")
	if dbUsed.known() && dbBefore.known() {
		b.ReportMetric(float64(dbUsed.since(dbBefore).Microseconds())/float64(n), "db-cpu-us/proxy")
	}
	// An upper bound on what the orchestrator holds per proxy: the whole
	// process's live heap, the NATS server and the answering backend in
	// it too.
	b.ReportMetric(float64(proxysynctest.HeapInUse()-heapBefore)/float64(n), "heap-B/proxy")
	if secs, _ := strconv.Atoi(os.Getenv("BENCH_STEADY_SECONDS")); secs > 0 {
		c0, w0 := cpuTime(), time.Now()
		t := time.NewTimer(time.Duration(secs) * time.Second)
		<-t.C
		b.ReportMetric(100*float64(cpuTime()-c0)/float64(time.Since(w0)), "steady-cpu-%")
	}
	// The orchestrator's side of a resync: the whole listing, paged as
	// lease and health page through it. What the health service keeps of
	// it for its verdicts is kept for the publisher below.
	listStart := time.Now()
	probed := make([]*proxyv1.Proxy, 0, n)
	if _, err := proxysync.List(ctx, client, func(page []*proxyv1.Proxy, _ int64) error {
		for _, p := range page {
			probed = append(probed, &proxyv1.Proxy{Uid: p.GetUid(), Name: p.GetName(),
				Status: &proxyv1.ProxyStatus{ProviderId: p.GetStatus().GetProviderId()}})
		}
		return nil
	}); err != nil || len(probed) != n {
		b.Fatalf("listing: %d proxies, %v; want %d", len(probed), err, n)
	}
	b.ReportMetric(time.Since(listStart).Seconds(), "s-to-list-all")

	// To Ready: a healthy verdict for every proxy's instance, published as
	// the health service publishes them but as fast as JetStream takes
	// them, until the orchestrator's store has every proxy Ready.
	readyStart := time.Now()
	if err := h.PublishVerdicts(ctx, probed, 1); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(n)/time.Since(readyStart).Seconds(), "verdicts/s")
	probed = nil
	waitPhase(b, h, n, proxyv1.ProxyPhase_PROXY_PHASE_READY, 10*time.Minute)
	toReady, readyAt := time.Since(readyStart), time.Since(start)
	b.ReportMetric(float64(n)/toReady.Seconds(), "ready/s")
	b.ReportMetric(toReady.Seconds(), "s-to-ready")
	w.report(b, proxyv1.ProxyPhase_PROXY_PHASE_READY, readyAt, "s-watch-ready", "watch-ready-lag-s")
	w.stop(b)
	// An upper bound on the orchestrator's memory as a process: the whole
	// test process's resident set, the NATS server, the backend, the
	// listing's leftovers and the earlier sizes' unreturned pages in it.
	rss := proctest.StatusBytes(b, os.Getpid(), "VmRSS")
	b.ReportMetric(float64(rss)/(1<<20), "rss-MiB")
	b.ReportMetric(float64(rss)/float64(n), "rss-B/proxy")
}

// watcher is a client following every proxy through WatchProxies, as a
// controller watching the fleet does: it keeps, per proxy, which of
// Running and Ready it has seen, and when it had seen all n in each.
type watcher struct {
	n      int
	cancel context.CancelFunc
	done   chan error

	mu     sync.Mutex
	start  time.Time
	seen   map[string]uint8 // by uid: 1 Running seen, 2 Ready seen
	counts [2]int
	at     [2]time.Duration // since start, when counts reached n
	events int
	all    [2]chan struct{}
}

// watch starts following from now: it returns once the watch is in place
// (the stream's header arrived), so no change after it is missed.
func watch(b *testing.B, client proxyv1.ProxyServiceClient, n int) *watcher {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := client.WatchProxies(ctx, &proxyv1.WatchProxiesRequest{})
	if err == nil {
		_, err = stream.Header()
	}
	if err != nil {
		cancel()
		b.Fatal(err)
	}
	w := &watcher{n: n, cancel: cancel, done: make(chan error, 1), seen: make(map[string]uint8, n),
		all: [2]chan struct{}{make(chan struct{}), make(chan struct{})}}
	go func() {
		for {
			resp, err := stream.Recv()
			if err != nil {
				w.done <- err
				return
			}
			w.observe(resp)
		}
	}()
	return w
}

func (w *watcher) from(start time.Time) {
	if w != nil {
		w.mu.Lock()
		w.start = start
		w.mu.Unlock()
	}
}

func (w *watcher) observe(resp *proxyv1.WatchProxiesResponse) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.events++
	i := -1
	switch resp.GetProxy().GetStatus().GetPhase() {
	case proxyv1.ProxyPhase_PROXY_PHASE_RUNNING:
		i = 0
	case proxyv1.ProxyPhase_PROXY_PHASE_READY:
		i = 1
	}
	uid := resp.GetProxy().GetUid()
	if i < 0 || w.seen[uid]&(1<<i) != 0 {
		return
	}
	w.seen[uid] |= 1 << i
	if w.counts[i]++; w.counts[i] == w.n {
		w.at[i] = time.Since(w.start)
		close(w.all[i])
	}
}

// report waits (at most 10 minutes) until the watcher has seen every
// proxy in phase, and reports when (since the first create) and how long
// after the store had them all (storeAt, since the first create).
func (w *watcher) report(b *testing.B, phase proxyv1.ProxyPhase, storeAt time.Duration, at, lag string) {
	b.Helper()
	if w == nil {
		return
	}
	i := 0
	if phase == proxyv1.ProxyPhase_PROXY_PHASE_READY {
		i = 1
	}
	t := time.NewTimer(10 * time.Minute)
	defer t.Stop()
	select {
	case <-w.all[i]:
	case err := <-w.done:
		b.Fatalf("watch ended: %v", err)
	case <-t.C:
		w.mu.Lock()
		defer w.mu.Unlock()
		b.Fatalf("watch: %d of %d proxies seen %s", w.counts[i], w.n, phase)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	b.ReportMetric(w.at[i].Seconds(), at)
	b.ReportMetric((w.at[i] - storeAt).Seconds(), lag)
	b.ReportMetric(float64(w.events), "watch-events")
}

func (w *watcher) stop(b *testing.B) {
	if w == nil {
		return
	}
	w.cancel()
	if err := <-w.done; status.Code(err) != codes.Canceled {
		b.Errorf("watch ended: %v", err)
	}
}

// waitPhase waits until all n proxies are in phase. Counting scans every
// proxy: the wait's poll backs off to 100ms so the measurement does not
// load what it measures.
func waitPhase(b *testing.B, h *orchtest.Harness, n int, phase proxyv1.ProxyPhase, timeout time.Duration) {
	b.Helper()
	name := strings.TrimPrefix(phase.String(), "PROXY_PHASE_")
	waittest.ForErr(b, timeout, fmt.Sprintf("%d proxies %s", n, name), func() error {
		var in int
		if err := h.Store.Pool().QueryRow(context.Background(), "SELECT count(*) FROM orchestrator.proxies WHERE phase = $1",
			int16(phase)).Scan(&in); err != nil {
			return err
		}
		if in != n {
			return fmt.Errorf("%d %s", in, name)
		}
		return nil
	})
}

// startSim runs a farm and one provisioner-sim replica (64 commands at
// once) serving provider fake on h's NATS, and returns the farm's shared
// port.
func startSim(b *testing.B, h *orchtest.Harness) uint32 {
	b.Helper()
	l, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		b.Fatal(err)
	}
	port := uint32(l.Addr().(*net.TCPAddr).Port)
	_ = l.Close()
	bin := proctest.Build(b, "../../../provisioner-sim")
	farm := proctest.Start(b, bin, []string{"farm", "--listen=127.0.0.1:0", fmt.Sprintf("--shared-port=%d", port)})
	api, _ := farm.WaitLog(b, time.Minute, proctest.Msg("farm ready"))["api"].(string)
	cfg := filepath.Join(b.TempDir(), "providers.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("providers:\n  - name: fake\n    type: sim\n    sim: {farm: %q}\n", api)), 0o600); err != nil {
		b.Fatal(err)
	}
	p := proctest.Start(b, bin, []string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0", "--auth-disabled",
		"--providers-config=" + cfg, "--provider=fake", "--nats-url=" + h.NATS.URL(), "--nats-prefix=" + h.Names.Prefix,
		"--max-concurrent=64"})
	p.WaitLog(b, time.Minute, proctest.Msg("serving"))
	return port
}

// cpuTime is the process's CPU (user and system) so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// backendsCPU is the CPU each backend of the benchmark's database had
// used, by process id; nil when PostgreSQL runs where /proc does not show
// its processes.
type backendsCPU map[int]time.Duration

func (c backendsCPU) known() bool { return c != nil }

// since is the CPU the backends used after before (a backend started
// since then counts whole; one that ended since then is missing).
func (c backendsCPU) since(before backendsCPU) time.Duration {
	var d time.Duration
	for pid, t := range c {
		d += t - before[pid]
	}
	return d
}

// dbCPU reads the CPU of the benchmark database's backends from /proc:
// the database's side of the converge when PostgreSQL runs on this
// machine.
func dbCPU(b *testing.B, h *orchtest.Harness) backendsCPU {
	rows, err := h.Store.Pool().Query(context.Background(), "SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
	if err != nil {
		b.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		b.Fatal(err)
	}
	out := backendsCPU{}
	for _, pid := range pids {
		d, err := proctest.ReadCPUTime(int(pid))
		if err != nil {
			return nil
		}
		out[int(pid)] = d
	}
	return out
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
