package integration

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/egress-proxies/egress-proxies/clients/go/egress"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The RoundTripper reports a banned answer, leaves that proxy for another
// and keeps the new one for the host; the service keeps the banned proxy
// away from the host.
func TestRoundTripperMovesOffBannedProxy(t *testing.T) {
	t.Parallel()
	s := newSuite(t, 3)
	var mu sync.Mutex
	banned := map[string]string{} // host → the proxy IP it bans
	bans := map[string]func() (int, string){
		"example.com":      func() (int, string) { return http.StatusForbidden, "forbidden" },
		"ratelimited.test": func() (int, string) { return http.StatusTooManyRequests, "slow down" },
		"challenge.test":   func() (int, string) { return http.StatusOK, `<form class="h-captcha">prove you are human</form>` },
		"form.test":        func() (int, string) { return http.StatusForbidden, "forbidden" },
	}
	s.site.setAnswer(func(host, ip string, first bool) (int, string) {
		mu.Lock()
		defer mu.Unlock()
		if banned[host] == "" {
			banned[host] = ip
		}
		if ban := bans[host]; ban != nil && banned[host] == ip {
			return ban()
		}
		return 0, ""
	})
	cases := []struct {
		url  string
		want leasev1.Outcome
	}{
		{"https://example.com/catalog", leasev1.Outcome_OUTCOME_BLOCKED},
		{"http://ratelimited.test/catalog", leasev1.Outcome_OUTCOME_BANNED},
		{"http://challenge.test/catalog", leasev1.Outcome_OUTCOME_CAPTCHA},
	}
	for _, tc := range cases {
		t.Run(tc.url, func(t *testing.T) {
			host := strings.Split(strings.SplitN(tc.url, "//", 2)[1], "/")[0]
			rt := &egress.RoundTripper{Client: s.client(egress.Options{}), TTL: 30 * time.Second}
			code, body, err := get(t, rt, tc.url)
			if err != nil || code != http.StatusOK || !strings.HasPrefix(body, "page /catalog via ") {
				t.Fatalf("GET %s = %d %q %v, want the page through another proxy", tc.url, code, body, err)
			}
			seen := s.site.sources(host)
			if len(seen) != 2 || seen[0] == seen[1] || !strings.HasSuffix(body, seen[1]) {
				t.Fatalf("the site saw %v for one GET, want the banned proxy then another", seen)
			}
			// The service knows the ban: a cooldown for this host on the
			// banned proxy, with the classified outcome.
			var bannedName string
			for i, p := range s.proxies {
				if p.ip == seen[0] {
					bannedName = proxySnapshot(i, p).GetName()
				}
			}
			var cd *leasev1.Cooldown
			for _, p := range s.list() {
				if p.GetProxyName() == bannedName {
					for _, c := range p.GetCooldowns() {
						if c.GetTargetHost() == host {
							cd = c
						}
					}
				}
			}
			if cd == nil || cd.GetOutcome() != tc.want {
				t.Fatalf("cooldown of %s for %s = %v, want outcome %v", bannedName, host, cd, tc.want)
			}
			// Later requests, concurrent ones too, stay on the new proxy
			// through the one lease.
			var wg sync.WaitGroup
			for range 5 {
				wg.Go(func() {
					if code, _, err := get(t, rt, tc.url); err != nil || code != http.StatusOK {
						t.Errorf("later GET = %d %v", code, err)
					}
				})
			}
			wg.Wait()
			for _, ip := range s.site.sources(host)[2:] {
				if ip != seen[1] {
					t.Fatalf("a later request went through %s, want %s", ip, seen[1])
				}
			}
			leases := rt.Leases()
			if len(leases) != 1 || s.proxyByName(leases[host].ProxyName).ip != seen[1] {
				t.Fatalf("leases held = %v, want one for %s on the new proxy", leases, host)
			}
			if err := rt.Close(); err != nil {
				t.Fatal(err)
			}
			if n := s.activeLeases(); n != 0 {
				t.Fatalf("%d active leases after Close", n)
			}
			if _, _, err := get(t, rt, tc.url); !errors.Is(err, egress.ErrRoundTripperClosed) {
				t.Errorf("GET after Close: %v", err)
			}
		})
	}

	// A request whose body cannot be sent again gets the ban answer
	// itself; the ban is still reported and the proxy left.
	t.Run("unreplayable body", func(t *testing.T) {
		rt := &egress.RoundTripper{Client: s.client(egress.Options{}), TTL: 30 * time.Second}
		defer rt.Close()
		req, _ := http.NewRequestWithContext(ctx(t), http.MethodPost, "http://form.test/form", struct{ *strings.Reader }{strings.NewReader("q=1")})
		resp, err := rt.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden || len(s.site.sources("form.test")) != 1 {
			t.Fatalf("POST = %d after %d sends, want the 403 after one", resp.StatusCode, len(s.site.sources("form.test")))
		}
		if len(rt.Leases()) != 0 {
			t.Errorf("the banned lease is still held: %v", rt.Leases())
		}
	})
}

// countingBackOff counts the waits between acquire attempts.
type countingBackOff struct {
	backoff.BackOff
	n *atomic.Int32
}

func (b countingBackOff) NextBackOff() time.Duration {
	b.n.Add(1)
	return b.BackOff.NextBackOff()
}

// While every proxy is taken the RoundTripper waits with backoff and gets
// one as soon as it is released; a cancelled request stops waiting.
func TestRoundTripperWaitsForAProxy(t *testing.T) {
	t.Parallel()
	s := newSuite(t, 1)
	holder := s.client(egress.Options{})
	var waits atomic.Int32
	c := s.client(egress.Options{AcquireBackoff: func() backoff.BackOff {
		b := egress.DefaultAcquireBackoff().(*backoff.ExponentialBackOff)
		b.InitialInterval, b.MaxInterval = 50*time.Millisecond, 200*time.Millisecond
		return countingBackOff{b, &waits}
	}})
	rt := &egress.RoundTripper{Client: c, TTL: 30 * time.Second}
	defer rt.Close()

	held, err := holder.Acquire(ctx(t), "", egress.Selector{}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		code int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		code, _, err := get(t, rt, "https://example.com/when-free")
		done <- result{code, err}
	}()
	waittest.For(t, 10*time.Second, "the RoundTripper retried twice", func() bool { return waits.Load() >= 2 })
	select {
	case r := <-done:
		t.Fatalf("GET returned while the only proxy was held: %v", r)
	default:
	}
	if err := held.Release(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.code != http.StatusOK {
		t.Fatalf("GET after the release = %d %v", r.code, r.err)
	}
	rt.Close()

	// Cancelled while waiting: the context's error and the last answer.
	held, err = holder.Acquire(ctx(t), "", egress.Selector{}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	rt2 := &egress.RoundTripper{Client: c, TTL: 30 * time.Second}
	defer rt2.Close()
	cctx, cancel := context.WithCancel(ctx(t))
	before := waits.Load()
	go func() {
		for waits.Load() < before+2 {
			time.Sleep(10 * time.Millisecond) // polling interval
		}
		cancel()
	}()
	req, _ := http.NewRequestWithContext(cctx, http.MethodGet, "https://example.com/never", nil)
	start := time.Now()
	_, err = rt2.RoundTrip(req)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, egress.ErrNoProxyAvailable) {
		t.Fatalf("cancelled GET = %v, want context.Canceled and the no-proxy answer", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("cancelled GET took %v", d)
	}
}

// A host's lease is released once no request of it has been in flight for
// IdleTimeout, never while one is; the next request leases again.
func TestRoundTripperReleasesIdleLeases(t *testing.T) {
	t.Parallel()
	s := newSuite(t, 1)
	const idle = 300 * time.Millisecond
	rt := &egress.RoundTripper{Client: s.client(egress.Options{}), TTL: 30 * time.Second, IdleTimeout: idle}
	defer rt.Close()

	if code, _, err := get(t, rt, "https://example.com/first"); err != nil || code != http.StatusOK {
		t.Fatalf("GET = %d %v", code, err)
	}
	first := rt.Leases()["example.com"]
	if first == nil {
		t.Fatal("no lease held after the first GET")
	}
	waittest.For(t, 10*time.Second, "the idle lease released", func() bool {
		return len(rt.Leases()) == 0 && s.activeLeases() == 0
	})
	if !errors.Is(first.Err(), egress.ErrReleased) {
		t.Fatalf("idle lease Err = %v", first.Err())
	}

	// A request in flight for many idle periods keeps its lease.
	done := make(chan error, 1)
	go func() {
		code, _, err := get(t, rt, "https://example.com/hold")
		if err == nil && code != http.StatusOK {
			err = errors.New(http.StatusText(code))
		}
		done <- err
	}()
	<-s.site.slow
	held := rt.Leases()["example.com"]
	start := time.Now()
	waittest.For(t, 10*time.Second, "five idle periods passed", func() bool { return time.Since(start) > 5*idle })
	if l := rt.Leases()["example.com"]; l == nil || l != held || l.Err() != nil || s.activeLeases() != 1 {
		t.Fatalf("the lease of a request in flight was released: %v", l)
	}
	s.site.hold <- struct{}{}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waittest.For(t, 10*time.Second, "released once idle", func() bool { return s.activeLeases() == 0 })
}
