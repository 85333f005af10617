//go:build bench

// Package bench measures the gateway against its baseline, the same load
// sent straight to one upstream proxy, in one run with the two alternating:
// a farm of upstream forward proxies on loopback addresses, a TLS and a
// plain-HTTP target, the real lease service over PostgreSQL and NATS, and
// the gateway as a process of its own (its CPU time and RSS read from
// /proc). Run it with `make bench-gateway`; docs/benchmarks/gateway.md
// records the figures. It is not part of `make test`: it measures, and
// asserts only that every tunnel and request got its answer.
package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

const (
	crawlerToken = "tok-bench-crawler-0123456789"
	gatewayToken = "tok-bench-gateway-0123456789"
	// leaseToken is the lease round trip's own client: with the gateway's
	// token its releases would reach the gateway's stream of ended leases.
	leaseToken = "tok-bench-lease-0123456789"
)

func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return d
}

// chartGatewayEnv is gateway.env of the Helm chart's default values, as
// KEY=VALUE: the bench runs the gateway as the chart does.
func chartGatewayEnv(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../../../deploy/helm/egress-proxies/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var values struct {
		Gateway struct {
			Env map[string]any `yaml:"env"`
		} `yaml:"gateway"`
	}
	if err := yaml.Unmarshal(b, &values); err != nil {
		t.Fatalf("the chart's values.yaml: %v", err)
	}
	var env []string
	for k, v := range values.Gateway.Env {
		env = append(env, fmt.Sprintf("%s=%v", k, v))
	}
	slices.Sort(env)
	return env
}

func envInts(t *testing.T, name string, def []int) []int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	var out []int
	for _, f := range strings.Fields(strings.ReplaceAll(v, ",", " ")) {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			t.Fatalf("%s: %q is no positive number", name, f)
		}
		out = append(out, n)
	}
	return out
}

func TestGatewayBench(t *testing.T) {
	dur := envDuration(t, "BENCH_DURATION", 5*time.Second)
	warmup := envDuration(t, "BENCH_WARMUP", time.Second)
	concurrency := envInts(t, "BENCH_CONCURRENCY", []int{1, 16, 64})
	farmSize := 4
	sessions := 10000
	if n := envInts(t, "BENCH_SESSIONS", []int{sessions}); len(n) == 1 {
		sessions = n[0]
	}
	profileDir := os.Getenv("BENCH_PROFILE_DIR")
	peers := choosePeers(t)

	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tokens := write("tokens", "gateway "+gatewayToken+" crawler,service\nbench "+crawlerToken+" crawler\nbench-lease "+leaseToken+" crawler\n")
	gwTokenFile := write("gateway-token", gatewayToken+"\n")

	// The lease service, over a database and a NATS server of its own.
	nats := natstest.New(t)
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "gwbench_empty", Fingerprint: "none",
		Migrate: func(context.Context, string) error { return nil }})
	leaseProc, lease := servicetest.Start(t, "../../lease", []string{"--database-url=" + dsn, "--nats-url=" + nats.URL(),
		"--auth-token-file=" + tokens, "--rate-limit-lease=0", "--log-level=info"}, "GOGC=400")

	farm := startFarm(t, farmSize)
	tg := startTargets(t)
	publishFarm(t, nats, farm)

	// The gateway, built as the images ship it (its RSS and CPU are the
	// shipped binary's), with the pprof endpoint when profiles are asked
	// for.
	var tags []string
	var pprofAddr string
	// The chart's runtime settings for the gateway, then
	// BENCH_GATEWAY_ENV: KEY=VALUE settings for the gateway alone (GOGC=50,
	// GOMAXPROCS=2), to compare runtime settings with the same binary; a
	// key given twice takes the later value.
	env := append(chartGatewayEnv(t), strings.Fields(os.Getenv("BENCH_GATEWAY_ENV"))...)
	if profileDir != "" {
		tags = append(tags, "pprof")
		pprofAddr = "127.0.0.1:18189"
		env = append(env, "EGRESS_GATEWAY_PPROF="+pprofAddr)
	}
	bin := proctest.BuildShipped(t, "..", tags...)
	gw := proctest.Start(t, bin, []string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0",
		"--auth-token-file=" + tokens, "--lease-addr=" + lease.GRPC, "--lease-token-file=" + gwTokenFile,
		"--proxy-listen=127.0.0.1:0", "--socks-listen=127.0.0.1:0", "--log-level=info"}, env...)
	line := gw.WaitLog(t, time.Minute, proctest.Msg("proxy listeners"))
	proxyAddr, _ := line["http"].(string)
	socksAddr, _ := line["socks5"].(string)
	pid := gw.PID()
	serving := gw.WaitLog(t, time.Minute, proctest.Msg("serving"))
	adminHTTP, _ := serving["http"].(string)
	metricsURL := "http://" + adminHTTP + "/metrics"

	direct := via{addr: farm[0].addr}
	session := gatewayVia(proxyAddr, socksAddr, "session-x", crawlerToken)
	rotation := gatewayVia(proxyAddr, socksAddr, "", crawlerToken)
	// modes are the gateway's; hops adds the peers to them for the loads
	// a peer can carry (not SOCKS5). peerSpread counts, per peer, what
	// each farm proxy served in that peer's runs.
	gwHop := hop{pid: pid, metricsURL: metricsURL}
	modes := []mode{{"session", session, gwHop}, {"rotation", rotation, gwHop}}
	hops := slices.Clone(modes)
	peerSpread := map[string][]int64{}
	for _, p := range peers {
		proc, addr := p.start(t, p.bin, farm)
		m := mode{p.name, via{addr: addr}, hop{pid: proc.PID(), peer: true}}
		waitAnswer(t, p.name, httpForwardOp(m.v, tg))
		hops = append(hops, m)
		peerSpread[p.name] = make([]int64, len(farm))
	}
	// farmServed is what each farm proxy has served so far (tunnels and
	// forwarded requests), to count the peer's share of it.
	farmServed := func() []int64 {
		n := make([]int64, len(farm))
		for i, p := range farm {
			n[i] = p.tunnels.Load() + p.forwarded.Load()
		}
		return n
	}

	// Ready when a request through the gateway reaches the target: the
	// lease service has the farm.
	waitAnswer(t, "the gateway", httpForwardOp(rotation, tg))

	fmt.Printf("== machine: %d cores, %s; load average %s\n", runtime.NumCPU(), cpuModel(), loadAvg())
	fmt.Printf("== %s per run after %s warm-up; farm of %d proxies; gateway pid %d (CPU from /proc/%d/stat), environment added %q\n",
		dur, warmup, farmSize, pid, pid, env)
	for i, p := range peers {
		m := hops[len(modes)+i]
		fmt.Printf("== peer: %s (%s) pid %d, rows with mode %s (CPU from /proc/%d/stat)\n", p.bin, p.version, m.hop.pid, m.name, m.hop.pid)
	}
	if len(peers) == 0 {
		fmt.Println("== peer: none (BENCH_PEER=none, or neither squid nor glider found): no peer rows")
	}

	// A run of the gateway or a direct one with an error fails the
	// bench; a peer's errors are its own and are printed at the end.
	var failed, peerErrors []string
	runWith := func(name string, c int, h hop, progress *atomic.Int64, newOp func() op) result {
		r := runLoad(t, c, warmup, dur, h.pid, leaseProc.PID(), h.metricsURL, progress, newOp)
		if progress != nil && r.bytes > 0 {
			// A bulk run's tunnel lasts the run: its bytes count, not
			// its op.
			r.ops = max(r.ops, 1)
		}
		if r.errs > 0 || r.ops == 0 {
			msg := fmt.Sprintf("%s C=%d: %d ok, %d errors (first: %v)", name, c, r.ops, r.errs, r.firstErr)
			if h.peer {
				peerErrors = append(peerErrors, msg)
			} else {
				failed = append(failed, msg)
			}
		}
		return r
	}
	run := func(name string, c int, h hop, newOp func() op) result {
		return runWith(name, c, h, nil, newOp)
	}
	// runHop runs a load through m, counting the farm's share of the
	// peer's runs.
	runHop := func(name string, c int, m mode, progress *atomic.Int64, newOp func() op) result {
		before := farmServed()
		r := runWith(name, c, m.hop, progress, newOp)
		if spread, ok := peerSpread[m.name]; ok {
			for i, n := range farmServed() {
				spread[i] += n - before[i]
			}
		}
		return r
	}
	same := func(o op) func() op { return func() op { return o } }

	// per1000 is CPU seconds per 1,000 of a run's ops.
	per1000 := func(d time.Duration, r result) float64 { return d.Seconds() / float64(r.ops) * 1000 }
	// The hop is the gateway (modes session and rotation) or a peer
	// (mode squid or glider, with no lease service: its lease and
	// acquire columns are "—").
	header := "| load | mode | C | direct /s | hop /s | ratio | p50 direct → hop (ms) | p99 direct → hop (ms) | hop CPU-s / 1,000 | lease CPU-s / 1,000 | bench CPU-s / 1,000 direct → hop | all CPU-s / 1,000 direct → hop | acquire in gw: ms mean (per op) | hop RSS (anon) MB | load avg |"
	sep := "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
	var memRows []string
	row := func(load, mode string, c int, d, g result) {
		lease, acquire := fmt.Sprintf("%.3f", per1000(g.lease, g)), fmt.Sprintf("%.2f (%.2f)", g.acquireMs(), g.acquires/float64(g.ops))
		hopAll := per1000(g.self+g.cpu+g.lease, g)
		if _, ok := peerSpread[mode]; ok {
			lease, acquire = "—", "—"
			hopAll = per1000(g.self+g.cpu, g)
		} else {
			memRows = append(memRows, fmt.Sprintf("| %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |",
				load, mode, c, mb(g.rss), mb(g.anon), mb(int64(g.mem.heapInuse)), mb(int64(g.mem.heapIdleKept)),
				mb(int64(g.mem.stacks)), mb(int64(g.mem.runtimeOther)), mb(int64(g.mem.gcGoal))))
		}
		fmt.Printf("| %s | %s | %d | %.0f | %.0f | **%.2f×** | %.2f → %.2f (%+.2f) | %.2f → %.2f (%+.2f) | %.3f | %s | %.3f → %.3f | %.3f → %.3f | %s | %.1f (%.1f) | %s |\n",
			load, mode, c, d.rate(), g.rate(), g.rate()/d.rate(),
			ms(d.pct(0.5)), ms(g.pct(0.5)), ms(g.pct(0.5)-d.pct(0.5)),
			ms(d.pct(0.99)), ms(g.pct(0.99)), ms(g.pct(0.99)-d.pct(0.99)),
			per1000(g.cpu, g), lease, per1000(d.self, d), per1000(g.self, g),
			per1000(d.self+d.lease, d), hopAll, acquire,
			float64(g.rss)/(1<<20), float64(g.anon)/(1<<20), g.load)
	}

	profile := func(name string) func() {
		if profileDir == "" {
			return func() {}
		}
		save := func(path, file string) {
			resp, err := http.Get(fmt.Sprintf("http://%s%s", pprofAddr, path))
			if err != nil {
				t.Logf("profile %s: %v", file, err)
				return
			}
			defer resp.Body.Close()
			f, err := os.Create(filepath.Join(profileDir, file))
			if err != nil {
				t.Logf("profile %s: %v", file, err)
				return
			}
			defer f.Close()
			_, _ = io.Copy(f, resp.Body)
		}
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			save(fmt.Sprintf("/debug/pprof/profile?seconds=%d", int((warmup+dur).Seconds())), name+".pprof")
		}()
		go func() {
			// The heap as the last collection left it, taken while the
			// load still runs: what the RSS at the run's end is made of.
			defer wg.Done()
			time.Sleep(warmup + dur*9/10)
			save("/debug/pprof/heap", name+".heap.pprof")
		}()
		return wg.Wait
	}

	// What rotation puts on each tunnel's critical path: an acquire round
	// trip to the lease service (its release goes in the background, as
	// the gateway's does), measured from here as a client of its own.
	leaseConn, err := (&service.Client{Addr: lease.GRPC, Token: leaseToken}).Dial()
	if err != nil {
		t.Fatal(err)
	}
	defer leaseConn.Close()
	leases := leasev1.NewLeaseServiceClient(leaseConn)
	fmt.Printf("\n### Lease round trip (AcquireLease, release in the background)\n\n")
	fmt.Println("| C | acquires/s | p50 ms | p99 ms | load avg |")
	fmt.Println("|---|---|---|---|---|")
	for _, c := range concurrency {
		r := run("acquire", c, hop{}, same(func(ctx context.Context) (int64, error) {
			resp, err := leases.AcquireLease(ctx, &leasev1.AcquireLeaseRequest{TargetHost: "127.0.0.1", Ttl: durationpb.New(time.Minute)})
			if err != nil {
				return 0, err
			}
			go func() {
				_, _ = leases.ReleaseLease(context.Background(), &leasev1.ReleaseLeaseRequest{LeaseId: resp.GetLease().GetLeaseId()})
			}()
			return 0, nil
		}))
		fmt.Printf("| %d | %.0f | %.2f | %.2f | %s |\n", c, r.rate(), ms(r.pct(0.5)), ms(r.pct(0.99)), r.load)
	}

	// Tunnels: a new tunnel per iteration (CONNECT, TLS handshake, one GET,
	// close), and the same without TLS; each gateway run follows a direct
	// run of its own.
	for _, k := range []struct {
		name string
		mk   func(v via) op
	}{
		{"TLS tunnel", func(v via) op { return tlsTunnelOp(v, tg, false) }},
		{"CONNECT, no TLS", func(v via) op { return plainTunnelOp(v, tg) }},
	} {
		fmt.Printf("\n### %s\n\n%s\n%s\n", k.name, header, sep)
		for _, c := range concurrency {
			for _, m := range hops {
				d := run(k.name+" direct", c, hop{}, same(k.mk(direct)))
				stop := func() {}
				if c == concurrency[len(concurrency)-1] && m.hop.metricsURL != "" {
					stop = profile(strings.ReplaceAll(k.name, " ", "")[:4] + "-" + m.name)
				}
				g := runHop(k.name+" "+m.name, c, m, nil, same(k.mk(m.v)))
				stop()
				row(k.name, m.name, c, d, g)
			}
		}
	}

	// HTTP forwarding: each client keeps its connection alive.
	fmt.Printf("\n### HTTP forwarding, keep-alive\n\n%s\n%s\n", header, sep)
	for _, c := range concurrency {
		for _, m := range hops {
			d := run("HTTP direct", c, hop{}, httpForwardOp(direct, tg))
			stop := func() {}
			if c == concurrency[len(concurrency)-1] && m.hop.metricsURL != "" {
				stop = profile("http-" + m.name)
			}
			g := runHop("HTTP "+m.name, c, m, nil, httpForwardOp(m.v, tg))
			stop()
			row("HTTP", m.name, c, d, g)
		}
	}

	// SOCKS5 against CONNECT through the gateway, alternating.
	fmt.Printf("\n### SOCKS5 against CONNECT (TLS tunnels, both through the gateway)\n\n")
	fmt.Println("| mode | C | CONNECT /s | SOCKS5 /s | SOCKS5 ÷ CONNECT | p50 CONNECT → SOCKS5 (ms) | p99 CONNECT → SOCKS5 (ms) | SOCKS5 CPU-s / 1,000 | load avg |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, c := range concurrency {
		for _, m := range modes {
			cn := run("CONNECT "+m.name, c, m.hop, same(tlsTunnelOp(m.v, tg, false)))
			sk := run("SOCKS5 "+m.name, c, m.hop, same(tlsTunnelOp(m.v, tg, true)))
			fmt.Printf("| %s | %d | %.0f | %.0f | **%.2f×** | %.2f → %.2f | %.2f → %.2f | %.3f | %s |\n",
				m.name, c, cn.rate(), sk.rate(), sk.rate()/cn.rate(),
				ms(cn.pct(0.5)), ms(sk.pct(0.5)), ms(cn.pct(0.99)), ms(sk.pct(0.99)),
				sk.cpu.Seconds()/float64(sk.ops)*1000, sk.load)
		}
	}

	// One long tunnel's throughput.
	fmt.Printf("\n### One long tunnel, bulk download\n\n")
	fmt.Println("| tunnel | mode | direct MB/s | hop MB/s | ratio | hop CPU-s / GB | bench CPU-s / GB direct → hop | hop RSS (anon) MB | load avg |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, useTLS := range []bool{true, false} {
		name := "TLS"
		if !useTLS {
			name = "plain"
		}
		for _, m := range hops {
			var dp, gp atomic.Int64
			d := runWith("bulk "+name+" direct", 1, hop{}, &dp, same(bulkOp(direct, tg, useTLS, &dp)))
			stop := func() {}
			if m.hop.metricsURL != "" {
				stop = profile("bulk-" + name + "-" + m.name)
			}
			g := runHop("bulk "+name+" "+m.name, 1, m, &gp, same(bulkOp(m.v, tg, useTLS, &gp)))
			stop()
			perGB := func(c time.Duration, r result) float64 { return c.Seconds() / (float64(r.bytes) / 1e9) }
			fmt.Printf("| %s | %s | %.0f | %.0f | **%.2f×** | %.3f | %.3f → %.3f | %.1f (%.1f) | %s |\n", name, m.name,
				mbps(d), mbps(g), mbps(g)/mbps(d), perGB(g.cpu, g), perGB(d.self, d), perGB(g.self, g),
				mb(g.rss), mb(g.anon), g.load)
		}
	}

	// Resident memory per 1,000 live sessions: one request each (16 at
	// a time), its connection closed after it, so what stays is the
	// sessions' own. Many sessions, so that they stand out of the
	// garbage collector's swings.
	time.Sleep(time.Second)
	rss0, anon0, _ := procRSS(t, pid)
	var next atomic.Int64
	var sessErrs atomic.Int64
	var sessErr atomic.Value
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1) - 1; i < int64(sessions); i = next.Add(1) - 1 {
				v := gatewayVia(proxyAddr, socksAddr, fmt.Sprintf("session-s%06d", i), crawlerToken)
				client := httpClient(v)
				resp, err := client.Get("http://" + tg.plainAddr + "/")
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					_ = resp.Body.Close()
					if err == nil && resp.StatusCode != http.StatusOK {
						err = fmt.Errorf("answer %d", resp.StatusCode)
					}
				}
				client.CloseIdleConnections()
				if err != nil {
					sessErrs.Add(1)
					sessErr.CompareAndSwap(nil, err.Error())
				}
			}
		}()
	}
	wg.Wait()
	if n := sessErrs.Load(); n > 0 {
		failed = append(failed, fmt.Sprintf("sessions: %d failed (first: %v)", n, sessErr.Load()))
	}
	time.Sleep(time.Second)
	rss1, anon1, hwm := procRSS(t, pid)
	fmt.Printf("\n### Memory\n\ngateway RSS (anonymous part) before %d new sessions %.1f (%.1f) MB, after %.1f (%.1f) MB: %+.2f (%+.2f) MB per 1,000 live sessions; peak RSS of the whole run (VmHWM) %.1f MB\n",
		sessions, mb(rss0), mb(anon0), mb(rss1), mb(anon1),
		mb(rss1-rss0)*1000/float64(sessions), mb(anon1-anon0)*1000/float64(sessions), mb(hwm))
	// Where the anonymous part goes, by the Go runtime's account at the
	// end of each gateway run (go_memstats_* on its /metrics; the heap's
	// free spans returned to the system are not counted, as they are not
	// resident).
	fmt.Printf("\n| load | mode | C | RSS MB | anon MB | heap in use MB | heap free, kept MB | stacks MB | runtime other MB | GC goal MB |\n|---|---|---|---|---|---|---|---|---|---|\n%s\n",
		strings.Join(memRows, "\n"))

	var spread []string
	for _, p := range farm {
		spread = append(spread, fmt.Sprintf("%s: %d tunnels, %d forwarded", p.addr, p.tunnels.Load(), p.forwarded.Load()))
	}
	fmt.Printf("\nfarm: %s\n", strings.Join(spread, "; "))
	for _, m := range hops[len(modes):] {
		var per []string
		for i, p := range farm {
			per = append(per, fmt.Sprintf("%s: %d", p.addr, peerSpread[m.name][i]))
		}
		fmt.Printf("farm, %s's runs only (tunnels and forwarded requests, warm-up included): %s\n", m.name, strings.Join(per, "; "))
		// A peer must have relayed through every farm proxy, not
		// straight to the target.
		for i, n := range peerSpread[m.name] {
			if n == 0 {
				failed = append(failed, fmt.Sprintf("%s: nothing went through farm proxy %s", m.name, farm[i].addr))
			}
		}
	}
	for _, e := range peerErrors {
		fmt.Printf("peer errors (not the gateway's; the bench does not fail on them): %s\n", e)
	}
	fmt.Printf("load average at the end: %s\n", loadAvg())
	for _, f := range failed {
		t.Error(f)
	}
}

// hop is the process a load goes through besides the farm, whose CPU
// time and RSS a run reads: the gateway (with its metrics), a peer, or
// none (pid 0) for the direct runs.
type hop struct {
	pid        int
	metricsURL string
	peer       bool
}

// mode is one way through a hop: the gateway in session or rotation
// mode, or a peer.
type mode struct {
	name string
	v    via
	hop  hop
}

// waitAnswer polls until a request through what newOp uses reaches the
// target (the lease service has the farm; a peer listens).
func waitAnswer(t *testing.T, what string, newOp func() op) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		_, err := newOp()(context.Background())
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no request through %s: %v", what, err)
		}
		time.Sleep(200 * time.Millisecond) // polling until it answers
	}
}

func mb(b int64) float64 { return float64(b) / (1 << 20) }

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func mbps(r result) float64 { return float64(r.bytes) / 1e6 / r.elapsed.Seconds() }

func cpuModel() string {
	b, _ := os.ReadFile("/proc/cpuinfo")
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}

// publishFarm publishes the farm as Ready, healthy proxies (as the
// orchestrator would), each with room for every load's leases.
func publishFarm(t *testing.T, nats *natstest.Server, farm []*farmProxy) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js := nats.JetStream(t)
	names := bus.Names{}
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	base := time.Now().UnixNano()
	healthTime := timestamppb.New(time.Now().Add(-time.Minute))
	for i, p := range farm {
		host, portStr, _ := strings.Cut(p.addr, ":")
		port, _ := strconv.Atoi(portStr)
		uid := fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
		pr := &proxyv1.Proxy{
			Uid: uid, Name: fmt.Sprintf("farm-%d", i), Labels: map[string]string{"pool": "bench"},
			Spec: &proxyv1.ProxySpec{
				Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "bench",
				Placement: &proxyv1.Placement{Region: "r1", Zone: "z1"},
				Lease:     &proxyv1.LeaseSpec{MaxLeases: proto.Uint32(100000)},
			},
			Status: &proxyv1.ProxyStatus{
				Phase: proxyv1.ProxyPhase_PROXY_PHASE_READY, Healthy: true, HealthTransitionTime: healthTime,
				ProviderId: "bench/" + uid, Ip: host, Port: uint32(port),
			},
		}
		ev := &busv1.ProxyEvent{Revision: base + int64(i), Type: proxyv1.ChangeType_CHANGE_TYPE_CREATED, Proxy: pr, ChangeTime: timestamppb.Now()}
		if _, err := bus.Publish(ctx, js, names.ProxyEventSubject(uid), ev); err != nil {
			t.Fatalf("publishing the farm: %v", err)
		}
	}
}
