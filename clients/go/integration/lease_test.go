package integration

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/egress-proxies/egress-proxies/clients/go/egress"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// A lease with a 1s TTL is still held, and its proxy still unavailable to
// others, after several TTLs; Release frees it at once.
func TestRenewKeepsLeasePastTTL(t *testing.T) {
	t.Parallel()
	s := newSuite(t, 1)
	c := s.client(egress.Options{})
	l, err := c.Acquire(ctx(t), "example.com", egress.Selector{}, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	first := l.Expiry()
	// The service sweeps expired leases every 200ms: once the local
	// expiry moved 3s past the first one, the lease has lived through
	// several TTLs only by renewals.
	waittest.For(t, 10*time.Second, "renewals moved the expiry 3s on", func() bool { return l.Expiry().Sub(first) > 3*time.Second })
	if err := l.Err(); err != nil {
		t.Fatalf("lease Err = %v after renewals", err)
	}
	if p := s.proxy("proxy-0"); p.GetActiveLeases() != 1 {
		t.Fatalf("active leases on the service = %d, want 1", p.GetActiveLeases())
	}
	var none *egress.NoProxyError
	if _, err := c.TryAcquire(ctx(t), "", egress.Selector{}, time.Second); !errors.As(err, &none) || none.AtCapacity != 1 {
		t.Fatalf("second acquire = %v, want no proxy available with 1 at capacity", err)
	}
	code, body, err := get(t, l.Transport(), "https://example.com/renewed")
	if err != nil || code != http.StatusOK || !strings.Contains(body, "page /renewed via 127.0.0.20") {
		t.Fatalf("fetch through the renewed lease: %d %q %v", code, body, err)
	}

	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(l.Err(), egress.ErrReleased) {
		t.Errorf("Err after Release = %v", l.Err())
	}
	select {
	case <-l.Done():
	default:
		t.Error("Done not closed after Release")
	}
	l2, err := c.TryAcquire(ctx(t), "", egress.Selector{}, time.Second)
	if err != nil {
		t.Fatalf("acquire after release: %v", err)
	}
	l2.Release()
	if _, _, err := get(t, l.Transport(), "https://example.com/after-release"); !errors.Is(err, egress.ErrReleased) {
		t.Errorf("request through a released lease: %v, want ErrReleased", err)
	}
}

// A lease the service no longer holds for the client is reported lost
// through Done, Err and OnLost, and its Transport refuses requests.
func TestLostLeaseIsReported(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		lose        func(t *testing.T, s *suite, l *egress.Lease)
		wantCode    codes.Code
		wantExpired bool
	}{
		{
			name: "released elsewhere",
			lose: func(t *testing.T, s *suite, l *egress.Lease) {
				if _, err := s.raw.ReleaseLease(ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: l.ID}); err != nil {
					t.Fatal(err)
				}
			},
			wantCode: codes.NotFound,
		},
		{
			name: "proxy no longer leasable",
			lose: func(t *testing.T, s *suite, l *egress.Lease) {
				p := proxySnapshot(0, s.proxies[0])
				p.Status.Healthy = false
				s.publish(p, 2)
			},
			wantCode: codes.FailedPrecondition,
		},
		{
			name: "service gone past the expiry",
			lose: func(t *testing.T, s *suite, l *egress.Lease) {
				s.proc.Signal(t, syscall.SIGSTOP)
				t.Cleanup(func() { s.proc.Signal(t, syscall.SIGCONT) })
			},
			wantCode:    codes.DeadlineExceeded,
			wantExpired: true,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newSuite(t, 1)
			lost := make(chan error, 1)
			c := s.client(egress.Options{CallTimeout: 500 * time.Millisecond, OnLost: func(_ *egress.Lease, err error) { lost <- err }})
			l, err := c.Acquire(ctx(t), "example.com", egress.Selector{}, 2*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			tc.lose(t, s, l)
			var got error
			select {
			case got = <-lost:
			case <-time.After(15 * time.Second):
				t.Fatal("OnLost not called in 15s")
			}
			select {
			case <-l.Done():
			default:
				t.Error("Done not closed when OnLost ran")
			}
			var le *egress.LostError
			if !errors.As(got, &le) || !errors.Is(l.Err(), got) || le.LeaseID != l.ID || le.Expired != tc.wantExpired {
				t.Fatalf("lost with %v (Err %v), want a LostError for %s, expired %v", got, l.Err(), l.ID, tc.wantExpired)
			}
			if code := status.Code(le.Cause); code != tc.wantCode {
				t.Errorf("cause %v, want code %v", le.Cause, tc.wantCode)
			}
			if tc.wantExpired && time.Now().Before(l.Expiry()) {
				t.Errorf("reported expired at %v, before the expiry %v", time.Now(), l.Expiry())
			}
			if _, _, err := get(t, l.Transport(), "https://example.com/after-loss"); !errors.As(err, &le) {
				t.Errorf("request through a lost lease: %v, want the LostError", err)
			}
			if tc.wantExpired {
				return // the service is stopped
			}
			// The client gave the slot back (after FAILED_PRECONDITION it
			// stays taken on the service until released): once the proxy
			// is leasable again, it is free.
			s.publish(proxySnapshot(0, s.proxies[0]), 3)
			s.waitLeasable(1)
			waittest.For(t, 5*time.Second, "no active lease on the service", func() bool { return s.activeLeases() == 0 })
			again, err := c.TryAcquire(ctx(t), "example.com", egress.Selector{}, 2*time.Second)
			if err != nil {
				t.Fatalf("acquire after the loss: %v", err)
			}
			again.Release()
			if err := l.Release(); err != nil {
				t.Errorf("Release after loss: %v", err)
			}
		})
	}
}

// Every way out of a crawl function that defers Release frees the proxy:
// return, error, panic, cancelled request; Client.Close releases what is
// still held.
func TestReleaseOnEveryExitPath(t *testing.T) {
	t.Parallel()
	s := newSuite(t, 1)
	c := s.client(egress.Options{})
	crawl := func(ctx context.Context, path string, exit func() error) (err error) {
		l, err := c.Acquire(ctx, "example.com", egress.Selector{}, 30*time.Second)
		if err != nil {
			return err
		}
		defer l.Release()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://example.com"+path, nil)
		resp, err := l.Transport().RoundTrip(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		return exit()
	}
	errPage := errors.New("page not parsed")
	cases := []struct {
		name string
		run  func() error
		want error
	}{
		{"return", func() error { return crawl(ctx(t), "/ok", func() error { return nil }) }, nil},
		{"error", func() error { return crawl(ctx(t), "/ok", func() error { return errPage }) }, errPage},
		{"panic", func() (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = errors.New("panicked")
				}
			}()
			return crawl(ctx(t), "/ok", func() error { panic("parser bug") })
		}, errors.New("panicked")},
		{"cancelled mid-request", func() error {
			c, cancel := context.WithCancel(ctx(t))
			go func() {
				select {
				case <-s.site.slow:
				case <-time.After(10 * time.Second):
				}
				cancel()
			}()
			return crawl(c, "/slow", func() error { return nil })
		}, context.Canceled},
	}
	for _, tc := range cases {
		err := tc.run()
		if (tc.want == nil) != (err == nil) || (tc.want != nil && !errors.Is(err, tc.want) && err.Error() != tc.want.Error()) {
			t.Fatalf("%s: crawl = %v, want %v", tc.name, err, tc.want)
		}
		if n := s.activeLeases(); n != 0 {
			t.Fatalf("%s: %d active leases after the crawl returned, want 0", tc.name, n)
		}
	}

	l, err := c.Acquire(ctx(t), "example.com", egress.Selector{}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(l.Err(), egress.ErrReleased) {
		t.Errorf("lease Err after Client.Close = %v", l.Err())
	}
	if n := s.activeLeases(); n != 0 {
		t.Fatalf("%d active leases after Client.Close, want 0", n)
	}
	if err := l.Release(); err != nil {
		t.Errorf("second Release: %v", err)
	}
}

// Reports start cooldowns with the outcome's scope: a ban keeps the proxy
// away from its target only, a timeout from every target; options
// override both.
func TestReportSetsCooldown(t *testing.T) {
	t.Parallel()
	// Three proxies: each of two global cooldowns below takes one out.
	s := newSuite(t, 3)
	c := s.client(egress.Options{})
	cases := []struct {
		target     string
		outcome    egress.Outcome
		opts       []egress.ReportOption
		wantGlobal bool
		wantAbout  time.Duration
	}{
		{target: "banned.test", outcome: egress.Banned, wantAbout: time.Hour},
		{target: "blocked.test", outcome: egress.Blocked, wantAbout: 5 * time.Minute},
		{target: "captcha.test", outcome: egress.Captcha, opts: []egress.ReportOption{egress.WithCooldown(2 * time.Minute)}, wantAbout: 2 * time.Minute},
		{target: "slow.test", outcome: egress.Timeout, wantGlobal: true, wantAbout: time.Minute},
		{target: "everywhere.test", outcome: egress.Banned, opts: []egress.ReportOption{egress.WithScope(egress.ScopeGlobal), egress.WithCooldown(90 * time.Second)}, wantGlobal: true, wantAbout: 90 * time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.target, func(t *testing.T) {
			l, err := c.Acquire(ctx(t), tc.target, egress.Selector{}, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			cd, err := l.Report(ctx(t), tc.outcome, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Release(); err != nil {
				t.Fatal(err)
			}
			wantTarget := tc.target
			if tc.wantGlobal {
				wantTarget = ""
			}
			if cd.Target != wantTarget || cd.Outcome != tc.outcome {
				t.Errorf("cooldown %+v, want target %q outcome %v", cd, wantTarget, tc.outcome)
			}
			if d := time.Until(cd.Until); d > tc.wantAbout || d < tc.wantAbout-time.Minute/2 {
				t.Errorf("cooldown lasts %v, want about %v", d, tc.wantAbout)
			}
			// Later acquires for the target never get the proxy.
			for range 4 {
				other, err := c.Acquire(ctx(t), tc.target, egress.Selector{}, 30*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				if other.ProxyName == l.ProxyName {
					t.Fatalf("%s leased for %s during its cooldown", l.ProxyName, tc.target)
				}
				other.Release()
			}
			only := egress.Selector{Labels: map[string]string{"id": l.ProxyName}}
			again, err := c.TryAcquire(ctx(t), "unrelated.test", only, 30*time.Second)
			if tc.wantGlobal {
				var none *egress.NoProxyError
				if !errors.As(err, &none) || none.CoolingDownGlobal != 1 {
					t.Fatalf("acquiring %s for another target: %v, want cooling down globally", l.ProxyName, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("acquiring %s for another target: %v", l.ProxyName, err)
			}
			if err := again.Release(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// Over its rate limit a client is told so (not "no proxy"), and Acquire
// waits the delay the service names, then gets its lease.
func TestAcquireWaitsOutTheRateLimit(t *testing.T) {
	t.Parallel()
	s := newSuiteTLS(t, 2, nil, "--rate-limit-lease=0.5", "--rate-limit-lease-burst=1")
	c := s.client(egress.Options{})
	first, err := c.TryAcquire(ctx(t), "limited.test", egress.Selector{}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Release()
	_, err = c.TryAcquire(ctx(t), "limited.test", egress.Selector{}, 30*time.Second)
	var limited *egress.RateLimitError
	if !errors.As(err, &limited) || errors.Is(err, egress.ErrNoProxyAvailable) || limited.RetryAfter < time.Second {
		t.Fatalf("second acquire = %v, want a rate limit naming a delay of 1s or more", err)
	}
	start := time.Now()
	l, err := c.Acquire(ctx(t), "limited.test", egress.Selector{}, 30*time.Second)
	if err != nil {
		t.Fatalf("acquire after the rate limit: %v", err)
	}
	if waited := time.Since(start); waited < time.Second {
		t.Errorf("Acquire got through after %v, before the refill", waited)
	}
	if l.ProxyName == first.ProxyName {
		t.Errorf("both leases on %s", l.ProxyName)
	}
	l.Release()
	first.Release()

	// The Python client over REST: 429 with Retry-After.
	script := `
import sys, time
from egress_proxies import LeaseClient, RateLimited
c = LeaseClient(sys.argv[1], sys.argv[2])
try:
    for _ in range(3):
        c.try_acquire("limited.test", ttl=30).release()
    print("never limited")
except RateLimited as e:
    print("limited", e.http_status, e.retry_after)
start = time.monotonic()
with c.acquire("limited.test", ttl=30, max_wait=30) as lease:
    print("leased after %.1fs" % (time.monotonic() - start))
c.close()
`
	cmd := exec.CommandContext(ctx(t), "/usr/bin/python3", "-c", script, "http://"+s.lease.HTTP, token)
	cmd.Env = append(os.Environ(), "PYTHONPATH=../../python", "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	var status int
	var retryAfter, after float64
	if _, err := fmt.Sscanf(string(out), "limited %d %g\nleased after %gs", &status, &retryAfter, &after); err != nil ||
		status != http.StatusTooManyRequests || retryAfter < 1 || after < 0.5 {
		t.Fatalf("python client under the rate limit:\n%s", out)
	}
}
