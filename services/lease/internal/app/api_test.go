package app_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/app"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

const (
	uidA = "00000000-0000-4000-8000-00000000000a"
	uidB = "00000000-0000-4000-8000-00000000000b"
	uidC = "00000000-0000-4000-8000-00000000000c"
	uidD = "00000000-0000-4000-8000-00000000000d"
	uidE = "00000000-0000-4000-8000-00000000000e"
)

// forEachTransport runs f as a parallel subtest per transport, each with
// its own service.
func forEachTransport(t *testing.T, opts lt.Options, f func(t *testing.T, env *lt.Env, c lt.Client)) {
	t.Helper()
	for _, tr := range lt.Transports {
		t.Run(tr, func(t *testing.T) {
			t.Parallel()
			env := lt.Start(t, opts)
			f(t, env, env.Client(tr, "crawler-a"))
		})
	}
}

func mustAcquire(t *testing.T, c lt.Client, req *leasev1.AcquireLeaseRequest) *leasev1.Lease {
	t.Helper()
	resp, r := c.Acquire(lt.Ctx(t), req)
	if r.Code() != codes.OK {
		t.Fatalf("%s AcquireLease(%v) = %v", c.Name(), req, r.Status)
	}
	return resp.GetLease()
}

func wantCode(t *testing.T, what string, r lt.Result, want codes.Code, wantHTTP int) {
	t.Helper()
	if r.Code() != want {
		t.Fatalf("%s = %v (%q), want %v", what, r.Code(), r.Status.Message(), want)
	}
	if r.HTTPCode != 0 && r.HTTPCode != wantHTTP {
		t.Fatalf("%s: HTTP %d, want %d", what, r.HTTPCode, wantHTTP)
	}
}

func noProxy(t *testing.T, r lt.Result) *leasev1.NoProxyAvailable {
	t.Helper()
	wantCode(t, "AcquireLease", r, codes.ResourceExhausted, http.StatusConflict)
	for _, d := range r.Status.Details() {
		if n, ok := d.(*leasev1.NoProxyAvailable); ok {
			return n
		}
	}
	t.Fatalf("RESOURCE_EXHAUSTED without a NoProxyAvailable detail: %v", r.Status.Details())
	return nil
}

func TestCapacity(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		maxLeases   *uint32
		defaultMax  int
		acquires    int
		wantGranted int
		wantMax     uint32
		wantFree    int32 // after the acquires
	}{
		{name: "explicit capacity 2", maxLeases: proto.Uint32(2), defaultMax: 1, acquires: 3, wantGranted: 2, wantMax: 2, wantFree: 0},
		{name: "unset takes the default", defaultMax: 3, acquires: 4, wantGranted: 3, wantMax: 3, wantFree: 0},
		{name: "MaxLeases 0 is unlimited", maxLeases: proto.Uint32(0), defaultMax: 1, acquires: 25, wantGranted: 25, wantMax: 0, wantFree: -1},
		{name: "default 0 is unlimited", defaultMax: 0, acquires: 25, wantGranted: 25, wantMax: 0, wantFree: -1},
		{name: "MaxLeases 1 is exclusive", maxLeases: proto.Uint32(1), defaultMax: 5, acquires: 2, wantGranted: 1, wantMax: 1, wantFree: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			opts := lt.Options{Config: func(c *app.Config) { c.DefaultMaxLeases = tc.defaultMax }}
			forEachTransport(t, opts, func(t *testing.T, env *lt.Env, c lt.Client) {
				p := lt.Proxy(uidA, "proxy-a")
				if tc.maxLeases != nil {
					lt.MaxLeases(*tc.maxLeases)(p)
				}
				env.Apply(t, p, 1)
				granted := 0
				for i := 0; i < tc.acquires; i++ {
					resp, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{})
					switch r.Code() {
					case codes.OK:
						granted++
						if resp.GetLease().GetProxyUid() != uidA {
							t.Fatalf("leased %s", resp.GetLease().GetProxyUid())
						}
					case codes.ResourceExhausted:
						n := noProxy(t, r)
						want := &leasev1.NoProxyAvailable{Matching: 1, AtCapacity: 1}
						if !proto.Equal(n, want) {
							t.Errorf("NoProxyAvailable = %v, want %v", n, want)
						}
					default:
						t.Fatalf("AcquireLease = %v", r.Status)
					}
				}
				if granted != tc.wantGranted {
					t.Errorf("granted %d of %d, want %d", granted, tc.acquires, tc.wantGranted)
				}
				list, r := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{})
				wantCode(t, "ListProxies", r, codes.OK, 200)
				if len(list.GetProxies()) != 1 {
					t.Fatalf("ListProxies = %v", list)
				}
				lp := list.GetProxies()[0]
				if lp.GetMaxLeases() != tc.wantMax || lp.GetActiveLeases() != uint32(tc.wantGranted) || lp.GetFreeCapacity() != tc.wantFree {
					t.Errorf("max %d active %d free %d, want %d %d %d", lp.GetMaxLeases(), lp.GetActiveLeases(), lp.GetFreeCapacity(),
						tc.wantMax, tc.wantGranted, tc.wantFree)
				}
			})
		})
	}
}

func TestSelectionOrder(t *testing.T) {
	t.Parallel()
	// The stable random tie-break orders proxies by a hash of their uid.
	lowB := store.Tiebreak(uidB) < store.Tiebreak(uidA)
	tieWinner := uidA
	if lowB {
		tieWinner = uidB
	}
	cases := []struct {
		name string
		// prepare leases and releases, moving the clock, then returns the
		// uid the next acquire must get.
		prepare func(t *testing.T, env *lt.Env, c lt.Client) string
	}{
		{
			name: "fewest active leases first",
			prepare: func(t *testing.T, env *lt.Env, c lt.Client) string {
				first := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
				other := uidA
				if first.GetProxyUid() == uidA {
					other = uidB
				}
				return other
			},
		},
		{
			name: "least recently leased among equally loaded",
			prepare: func(t *testing.T, env *lt.Env, c lt.Client) string {
				first := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
				env.Clock.Advance(time.Second)
				second := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
				for _, l := range []*leasev1.Lease{second, first} {
					if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()}); r.Code() != codes.OK {
						t.Fatal(r.Status)
					}
				}
				return first.GetProxyUid()
			},
		},
		{
			name: "never leased before recently leased",
			prepare: func(t *testing.T, env *lt.Env, c lt.Client) string {
				// Lease the tie-break winner and release it: it is now
				// recently leased, the other never was.
				first := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
				if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: first.GetLeaseId()}); r.Code() != codes.OK {
					t.Fatal(r.Status)
				}
				if first.GetProxyUid() == uidA {
					return uidB
				}
				return uidA
			},
		},
		{
			name:    "stable random tie-break",
			prepare: func(*testing.T, *lt.Env, lt.Client) string { return tieWinner },
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			opts := lt.Options{Config: func(c *app.Config) { c.DefaultMaxLeases = 5 }}
			forEachTransport(t, opts, func(t *testing.T, env *lt.Env, c lt.Client) {
				env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
				env.Apply(t, lt.Proxy(uidB, "proxy-b"), 2)
				want := tc.prepare(t, env, c)
				env.Clock.Advance(time.Second)
				got := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
				if got.GetProxyUid() != want {
					t.Errorf("leased %s, want %s", got.GetProxyUid(), want)
				}
			})
		})
	}
}

func TestCooldowns(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		target     string
		report     *leasev1.ReportOutcomeRequest
		wantTarget string // target of the cooldown started; "-" for none
		wantLength time.Duration
		// blocked and allowed are targets that acquire cannot / can get
		// the proxy for while it cools down ("" is no target).
		blocked, allowed []string
	}{
		{name: "banned cools the target for an hour", target: "shop.example.com",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_BANNED},
			wantTarget: "shop.example.com", wantLength: time.Hour,
			blocked: []string{"shop.example.com"}, allowed: []string{"other.example.com", ""}},
		{name: "blocked cools the target 5m", target: "shop.example.com",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_BLOCKED},
			wantTarget: "shop.example.com", wantLength: 5 * time.Minute,
			blocked: []string{"shop.example.com"}, allowed: []string{"news.example.org"}},
		{name: "captcha cools the target 10m", target: "shop.example.com",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_CAPTCHA},
			wantTarget: "shop.example.com", wantLength: 10 * time.Minute,
			blocked: []string{"shop.example.com"}, allowed: []string{""}},
		{name: "timeout cools globally for 1m", target: "shop.example.com",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_TIMEOUT},
			wantTarget: "", wantLength: time.Minute,
			blocked: []string{"shop.example.com", "other.example.com", ""}},
		{name: "error cools globally for 30s", target: "shop.example.com",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_ERROR},
			wantTarget: "", wantLength: 30 * time.Second,
			blocked: []string{"shop.example.com", ""}},
		{name: "success starts none", target: "shop.example.com",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_SUCCESS},
			wantTarget: "-", allowed: []string{"shop.example.com", ""}},
		{name: "explicit global scope and length", target: "shop.example.com",
			report: &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_BANNED,
				Scope: leasev1.CooldownScope_COOLDOWN_SCOPE_GLOBAL, Cooldown: durationpb.New(2 * time.Minute)},
			wantTarget: "", wantLength: 2 * time.Minute, blocked: []string{"other.example.com", ""}},
		{name: "explicit target scope overrides a global default", target: "shop.example.com",
			report: &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_TIMEOUT,
				Scope: leasev1.CooldownScope_COOLDOWN_SCOPE_TARGET},
			wantTarget: "shop.example.com", wantLength: time.Minute,
			blocked: []string{"shop.example.com"}, allowed: []string{"other.example.com"}},
		{name: "target scope without a target is global", target: "",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_BANNED},
			wantTarget: "", wantLength: time.Hour, blocked: []string{"", "shop.example.com"}},
		{name: "zero cooldown starts none", target: "shop.example.com",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_BANNED, Cooldown: durationpb.New(0)},
			wantTarget: "-", allowed: []string{"shop.example.com"}},
		{name: "target names are case-insensitive", target: "Shop.Example.COM",
			report:     &leasev1.ReportOutcomeRequest{Outcome: leasev1.Outcome_OUTCOME_BANNED},
			wantTarget: "shop.example.com", wantLength: time.Hour, blocked: []string{"SHOP.example.com."}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			opts := lt.Options{Config: func(c *app.Config) { c.DefaultMaxLeases = 0 }}
			forEachTransport(t, opts, func(t *testing.T, env *lt.Env, c lt.Client) {
				env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
				l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{TargetHost: tc.target})
				report := proto.Clone(tc.report).(*leasev1.ReportOutcomeRequest)
				report.LeaseId = l.GetLeaseId()
				resp, r := c.Report(lt.Ctx(t), report)
				wantCode(t, "ReportOutcome", r, codes.OK, 200)
				now := env.Clock.Now()
				if tc.wantTarget == "-" {
					if resp.GetCooldown() != nil {
						t.Fatalf("cooldown %v, want none", resp.GetCooldown())
					}
				} else {
					cd := resp.GetCooldown()
					if cd.GetTargetHost() != tc.wantTarget || !cd.GetExpireTime().AsTime().Equal(now.Add(tc.wantLength)) ||
						cd.GetOutcome() != tc.report.GetOutcome() {
						t.Fatalf("cooldown %v, want target %q until %v", cd, tc.wantTarget, now.Add(tc.wantLength))
					}
				}
				for _, target := range tc.blocked {
					_, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{TargetHost: target})
					n := noProxy(t, r)
					want := &leasev1.NoProxyAvailable{Matching: 1}
					if tc.wantTarget == "" {
						want.CoolingDownGlobal = 1
					} else {
						want.CoolingDownTarget = 1
					}
					if !proto.Equal(n, want) {
						t.Errorf("acquire for %q: %v, want %v", target, n, want)
					}
				}
				for _, target := range tc.allowed {
					mustAcquire(t, c, &leasev1.AcquireLeaseRequest{TargetHost: target})
				}
				if tc.wantTarget != "-" {
					list, _ := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{})
					if cds := list.GetProxies()[0].GetCooldowns(); len(cds) != 1 || cds[0].GetTargetHost() != tc.wantTarget {
						t.Errorf("ListProxies cooldowns = %v", cds)
					}
					// The cooldown ends with the clock.
					env.Clock.Advance(tc.wantLength)
					for _, target := range tc.blocked {
						mustAcquire(t, c, &leasev1.AcquireLeaseRequest{TargetHost: target})
					}
					list, _ = c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{})
					if cds := list.GetProxies()[0].GetCooldowns(); len(cds) != 0 {
						t.Errorf("ListProxies cooldowns after expiry = %v", cds)
					}
				}
			})
		})
	}
}

func TestLongerCooldownWins(t *testing.T) {
	t.Parallel()
	forEachTransport(t, lt.Options{Config: func(c *app.Config) { c.DefaultMaxLeases = 0 }}, func(t *testing.T, env *lt.Env, c lt.Client) {
		env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
		l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com"})
		now := env.Clock.Now()
		r1, _ := c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED})
		r2, r := c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BLOCKED})
		wantCode(t, "second report", r, codes.OK, 200)
		if !r1.GetCooldown().GetExpireTime().AsTime().Equal(now.Add(time.Hour)) ||
			!proto.Equal(r1.GetCooldown(), r2.GetCooldown()) {
			t.Errorf("a shorter report replaced the longer cooldown: %v then %v", r1.GetCooldown(), r2.GetCooldown())
		}
	})
}

func TestExpiryAndRetention(t *testing.T) {
	t.Parallel()
	opts := lt.Options{Config: func(c *app.Config) { c.Retention = 10 * time.Minute }}
	forEachTransport(t, opts, func(t *testing.T, env *lt.Env, c lt.Client) {
		env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
		l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com", Ttl: durationpb.New(10 * time.Second)})
		if got := l.GetExpireTime().AsTime().Sub(l.GetAcquireTime().AsTime()); got != 10*time.Second {
			t.Fatalf("lease lasts %v, want 10s", got)
		}
		// Renew moves the expiry from now.
		env.Clock.Advance(5 * time.Second)
		rn, r := c.Renew(lt.Ctx(t), &leasev1.RenewLeaseRequest{LeaseId: l.GetLeaseId(), Ttl: durationpb.New(10 * time.Second)})
		wantCode(t, "RenewLease", r, codes.OK, 200)
		if !rn.GetLease().GetExpireTime().AsTime().Equal(env.Clock.Now().Add(10 * time.Second)) {
			t.Fatalf("renewed until %v", rn.GetLease().GetExpireTime().AsTime())
		}
		_, r = c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{})
		if n := noProxy(t, r); n.GetAtCapacity() != 1 {
			t.Fatalf("%v", n)
		}
		env.Clock.Advance(11 * time.Second)
		res, err := env.Parts.Store.Sweep(lt.Ctx(t))
		if err != nil || res.Expired != 1 {
			t.Fatalf("Sweep = %+v, %v; want 1 expired", res, err)
		}
		// The capacity is free again.
		l2 := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
		if _, r := c.Renew(lt.Ctx(t), &leasev1.RenewLeaseRequest{LeaseId: l.GetLeaseId()}); r.Code() != codes.NotFound {
			t.Errorf("renewing an expired lease: %v, want NOT_FOUND", r.Status)
		}
		rel, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()})
		wantCode(t, "releasing an expired lease", r, codes.OK, 200)
		if rel.GetReleased() {
			t.Error("releasing an expired lease says it ended an active one")
		}
		// A report on the retained lease counts.
		rep, r := c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED})
		wantCode(t, "report on a retained lease", r, codes.OK, 200)
		if rep.GetCooldown().GetTargetHost() != "shop.example.com" {
			t.Errorf("cooldown %v", rep.GetCooldown())
		}
		if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: l2.GetLeaseId()}); r.Code() != codes.OK {
			t.Fatal(r.Status)
		}
		_, r = c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com"})
		if n := noProxy(t, r); n.GetCoolingDownTarget() != 1 {
			t.Errorf("after the retained report: %v", n)
		}
		// Past retention the lease is gone.
		env.Clock.Advance(11 * time.Minute)
		if res, err := env.Parts.Store.Sweep(lt.Ctx(t)); err != nil || res.Purged < 1 {
			t.Fatalf("Sweep = %+v, %v; want purged", res, err)
		}
		_, r = c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED})
		wantCode(t, "report past retention", r, codes.NotFound, http.StatusNotFound)
	})
}

func TestReleaseIdempotentAndOwned(t *testing.T) {
	t.Parallel()
	forEachTransport(t, lt.Options{}, func(t *testing.T, env *lt.Env, c lt.Client) {
		env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
		l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
		other := env.Client(c.Name(), "crawler-b")
		if _, r := other.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()}); r.Code() != codes.PermissionDenied {
			t.Errorf("another client's release: %v, want PERMISSION_DENIED", r.Status)
		}
		if _, r := other.Renew(lt.Ctx(t), &leasev1.RenewLeaseRequest{LeaseId: l.GetLeaseId()}); r.Code() != codes.PermissionDenied {
			t.Errorf("another client's renew: %v, want PERMISSION_DENIED", r.Status)
		}
		if _, r := other.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED}); r.Code() != codes.PermissionDenied {
			t.Errorf("another client's report: %v, want PERMISSION_DENIED", r.Status)
		}
		for i, want := range []bool{true, false, false} {
			resp, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()})
			wantCode(t, "ReleaseLease", r, codes.OK, 200)
			if resp.GetReleased() != want {
				t.Errorf("release #%d: released=%v, want %v", i+1, resp.GetReleased(), want)
			}
		}
		if _, r := c.Renew(lt.Ctx(t), &leasev1.RenewLeaseRequest{LeaseId: l.GetLeaseId()}); r.Code() != codes.NotFound {
			t.Errorf("renew after release: %v, want NOT_FOUND", r.Status)
		}
		unknown := "123e4567-e89b-42d3-a456-426614174000"
		_, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: unknown})
		wantCode(t, "release of an unknown lease", r, codes.NotFound, http.StatusNotFound)
		list, _ := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{})
		if got := list.GetProxies()[0].GetActiveLeases(); got != 0 {
			t.Errorf("active leases after releases = %d", got)
		}
	})
}

func TestRenewOnUnleasableProxy(t *testing.T) {
	t.Parallel()
	forEachTransport(t, lt.Options{}, func(t *testing.T, env *lt.Env, c lt.Client) {
		env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
		l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{})
		env.Apply(t, lt.Proxy(uidA, "proxy-a", func(p *proxyv1.Proxy) { p.Status.Phase = proxyv1.ProxyPhase_PROXY_PHASE_RUNNING }), 2)
		_, r := c.Renew(lt.Ctx(t), &leasev1.RenewLeaseRequest{LeaseId: l.GetLeaseId()})
		wantCode(t, "renew on a proxy no longer Ready", r, codes.FailedPrecondition, http.StatusBadRequest)
	})
}

func Test409Arithmetic(t *testing.T) {
	t.Parallel()
	forEachTransport(t, lt.Options{Config: func(c *app.Config) { c.DefaultMaxLeases = 1 }}, func(t *testing.T, env *lt.Env, c lt.Client) {
		const target = "shop.example.com"
		// Six proxies in pool "x", each ruled out for a different reason,
		// and one outside the selector.
		env.Apply(t, lt.Proxy(uidA, "unhealthy", func(p *proxyv1.Proxy) {
			p.Labels["pool"] = "x"
			p.Status.Healthy = false
			p.Status.Phase = proxyv1.ProxyPhase_PROXY_PHASE_RUNNING
		}), 1)
		env.Apply(t, lt.Proxy(uidB, "full", func(p *proxyv1.Proxy) { p.Labels["pool"] = "x" }), 2)
		env.Apply(t, lt.Proxy(uidC, "cool-target", func(p *proxyv1.Proxy) { p.Labels["pool"] = "x"; lt.MaxLeases(2)(p) }), 3)
		env.Apply(t, lt.Proxy(uidD, "cool-global", func(p *proxyv1.Proxy) { p.Labels["pool"] = "x"; lt.MaxLeases(2)(p) }), 4)
		env.Apply(t, lt.Proxy(uidE, "elsewhere", func(p *proxyv1.Proxy) { lt.MaxLeases(0)(p) }), 5)
		// Fill "full"; cool "cool-target" for the target and "cool-global"
		// everywhere, each through a lease of its own.
		sel := &leasev1.ProxySelector{Labels: map[string]string{"pool": "x"}}
		seen := map[string]*leasev1.Lease{}
		for range 3 {
			l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{TargetHost: target, Selector: sel})
			seen[l.GetProxyName()] = l
		}
		for _, name := range []string{"full", "cool-target", "cool-global"} {
			if seen[name] == nil {
				t.Fatalf("three acquires leased %v", seen)
			}
		}
		scope := map[string]leasev1.CooldownScope{"cool-target": leasev1.CooldownScope_COOLDOWN_SCOPE_TARGET, "cool-global": leasev1.CooldownScope_COOLDOWN_SCOPE_GLOBAL}
		for name, sc := range scope {
			if _, r := c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: seen[name].GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED, Scope: sc}); r.Code() != codes.OK {
				t.Fatal(r.Status)
			}
		}
		cases := []struct {
			name string
			req  *leasev1.AcquireLeaseRequest
			want *leasev1.NoProxyAvailable
		}{
			{"for the target", &leasev1.AcquireLeaseRequest{TargetHost: target, Selector: sel},
				&leasev1.NoProxyAvailable{Matching: 4, Unhealthy: 1, AtCapacity: 1, CoolingDownTarget: 1, CoolingDownGlobal: 1}},
			{"no selector match", &leasev1.AcquireLeaseRequest{Selector: &leasev1.ProxySelector{Provider: "gce"}},
				&leasev1.NoProxyAvailable{}},
			{"region and zone narrow too", &leasev1.AcquireLeaseRequest{TargetHost: target, Selector: &leasev1.ProxySelector{Region: "eu", Zone: "eu-1", Labels: map[string]string{"pool": "x"}}},
				&leasev1.NoProxyAvailable{Matching: 4, Unhealthy: 1, AtCapacity: 1, CoolingDownTarget: 1, CoolingDownGlobal: 1}},
		}
		for _, tc := range cases {
			_, r := c.Acquire(lt.Ctx(t), tc.req)
			if n := noProxy(t, r); !proto.Equal(n, tc.want) {
				t.Errorf("%s: %v, want %v", tc.name, n, tc.want)
			}
		}
		// Without a target, cool-target qualifies again.
		l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{Selector: sel})
		if l.GetProxyName() != "cool-target" {
			t.Errorf("leased %s, want cool-target", l.GetProxyName())
		}
		// A proxy at capacity that also cools down counts as at capacity.
		_, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{TargetHost: target, Selector: sel})
		want := &leasev1.NoProxyAvailable{Matching: 4, Unhealthy: 1, AtCapacity: 2, CoolingDownGlobal: 1}
		if n := noProxy(t, r); !proto.Equal(n, want) {
			t.Errorf("with cool-target full: %v, want %v", n, want)
		}
		// The message carries the same arithmetic for humans.
		if !strings.Contains(r.Status.Message(), "4 matching") {
			t.Errorf("message %q", r.Status.Message())
		}
	})
}

func TestListFilters(t *testing.T) {
	t.Parallel()
	forEachTransport(t, lt.Options{}, func(t *testing.T, env *lt.Env, c lt.Client) {
		env.Apply(t, lt.Proxy(uidA, "a-kvm-eu"), 1)
		env.Apply(t, lt.Proxy(uidB, "b-gce-us", func(p *proxyv1.Proxy) {
			p.Spec.Provider = "gce"
			p.Spec.Placement = &proxyv1.Placement{Region: "us-east1", Zone: "us-east1-b"}
			p.Labels = map[string]string{"pool": "premium", "tier": "1"}
		}), 2)
		env.Apply(t, lt.Proxy(uidC, "c-external", func(p *proxyv1.Proxy) {
			p.Spec = &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "proxy.example.net", Port: 8080}}
			p.Status.Ip = ""
			p.Status.Port = 0
		}), 3)
		env.Apply(t, lt.Proxy(uidD, "d-not-ready", func(p *proxyv1.Proxy) { p.Status.Phase = proxyv1.ProxyPhase_PROXY_PHASE_RUNNING }), 4)
		cases := []struct {
			sel  *leasev1.ProxySelector
			want []string
		}{
			{nil, []string{"a-kvm-eu", "b-gce-us", "c-external"}},
			{&leasev1.ProxySelector{Provider: "gce"}, []string{"b-gce-us"}},
			{&leasev1.ProxySelector{Region: "eu"}, []string{"a-kvm-eu"}},
			{&leasev1.ProxySelector{Zone: "us-east1-b"}, []string{"b-gce-us"}},
			{&leasev1.ProxySelector{Labels: map[string]string{"pool": "premium"}}, []string{"b-gce-us"}},
			{&leasev1.ProxySelector{Labels: map[string]string{"pool": "premium", "tier": "2"}}, nil},
			{&leasev1.ProxySelector{Provider: "nope"}, nil},
		}
		for _, tc := range cases {
			resp, r := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{Selector: tc.sel})
			wantCode(t, "ListProxies", r, codes.OK, 200)
			var got []string
			for _, p := range resp.GetProxies() {
				got = append(got, p.GetProxyName())
				if p.GetProxyName() == "c-external" {
					if a := p.GetAddress(); a.GetHost() != "proxy.example.net" || a.GetPort() != 8080 || a.GetScheme() != "http" {
						t.Errorf("external address %v", a)
					}
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("ListProxies(%v) = %v, want %v", tc.sel, got, tc.want)
			}
		}
		// The grant carries the address.
		l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{Selector: &leasev1.ProxySelector{Provider: "gce"}, TargetHost: "shop.example.com"})
		if l.GetProxyName() != "b-gce-us" || l.GetAddress().GetPort() != 3128 || l.GetAddress().GetScheme() != "http" ||
			l.GetClientId() != "crawler-a" || l.GetTargetHost() != "shop.example.com" || l.GetAddress().GetHost() == "" {
			t.Errorf("lease %v", l)
		}
	})
}

// ListProxies pages by name with page_size and the token of the previous
// page; without a page size it answers every proxy at once.
func TestListProxiesPages(t *testing.T) {
	t.Parallel()
	forEachTransport(t, lt.Options{}, func(t *testing.T, env *lt.Env, c lt.Client) {
		var want []string
		for i := range 5 {
			name := fmt.Sprintf("page-%d", i)
			env.Apply(t, lt.Proxy(fmt.Sprintf("00000000-0000-4000-8000-0000000001%02d", i), name, func(p *proxyv1.Proxy) {
				p.Labels = map[string]string{"pool": "paged"}
			}), int64(i+1))
			want = append(want, name)
		}
		sel := &leasev1.ProxySelector{Labels: map[string]string{"pool": "paged"}}
		var got []string
		token, pages := "", 0
		for {
			resp, r := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{Selector: sel, PageSize: 2, PageToken: token})
			wantCode(t, "ListProxies", r, codes.OK, 200)
			pages++
			for _, p := range resp.GetProxies() {
				got = append(got, p.GetProxyName())
			}
			if token = resp.GetNextPageToken(); token == "" {
				break
			}
			if pages > 5 {
				t.Fatal("more pages than proxies")
			}
		}
		if !slices.Equal(got, want) || pages != 3 {
			t.Errorf("paged listing = %v in %d pages, want %v in 3", got, pages, want)
		}
		all, r := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{Selector: sel})
		wantCode(t, "ListProxies", r, codes.OK, 200)
		if len(all.GetProxies()) != 5 || all.GetNextPageToken() != "" {
			t.Errorf("unpaged listing: %d proxies, token %q; want 5 and none", len(all.GetProxies()), all.GetNextPageToken())
		}
		// A token is for its selector only.
		first, _ := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{Selector: sel, PageSize: 2})
		_, r = c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{PageSize: 2, PageToken: first.GetNextPageToken()})
		wantCode(t, "ListProxies with another selector's token", r, codes.InvalidArgument, 400)
		_, r = c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{Selector: sel, PageSize: 2, PageToken: "not-a-token"})
		wantCode(t, "ListProxies with a made-up token", r, codes.InvalidArgument, 400)
	})
}

func TestAuthMatrix(t *testing.T) {
	t.Parallel()
	env := lt.Start(t, lt.Options{})
	env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
	for _, tr := range lt.Transports {
		for _, tc := range []struct {
			client   string
			want     codes.Code
			wantHTTP int
		}{
			{"", codes.Unauthenticated, http.StatusUnauthorized},
			{"not-a-valid-token", codes.Unauthenticated, http.StatusUnauthorized},
			{"crawler-b", codes.OK, http.StatusOK},
		} {
			t.Run(fmt.Sprintf("%s/%q", tr, tc.client), func(t *testing.T) {
				_, r := env.Client(tr, tc.client).List(lt.Ctx(t), &leasev1.ListProxiesRequest{})
				wantCode(t, "ListProxies", r, tc.want, tc.wantHTTP)
				if strings.Contains(r.Status.Message(), "not-a-valid-token") {
					t.Errorf("the error echoes the token: %q", r.Status.Message())
				}
			})
		}
	}
	t.Run("health and metrics are exempt", func(t *testing.T) {
		for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
			code, _, err := lt.Raw(lt.Ctx(t), http.MethodGet, "http://"+env.HTTPAddr+path, "", nil)
			if err != nil || code != http.StatusOK {
				t.Errorf("GET %s without a token = %d, %v", path, code, err)
			}
		}
		conn, err := grpc.NewClient(env.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		resp, err := healthpb.NewHealthClient(conn).Check(lt.Ctx(t), &healthpb.HealthCheckRequest{})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("gRPC health without a token = %v, %v", resp, err)
		}
	})
	t.Run("auth disabled is anonymous", func(t *testing.T) {
		open := lt.Start(t, lt.Options{AuthDisabled: true})
		open.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
		l := mustAcquire(t, open.Client("rest", ""), &leasev1.AcquireLeaseRequest{})
		if l.GetClientId() != "anonymous" {
			t.Errorf("client id %q", l.GetClientId())
		}
	})
}

func TestInvalidRequests(t *testing.T) {
	t.Parallel()
	validID := "123e4567-e89b-42d3-a456-426614174000"
	cases := []struct {
		name  string
		call  func(ctx context.Context, c lt.Client) lt.Result
		field string
	}{
		{"ttl below the minimum", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{Ttl: durationpb.New(time.Second)})
			return r
		}, "ttl"},
		{"ttl above the maximum", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{Ttl: durationpb.New(2 * time.Hour)})
			return r
		}, "ttl"},
		{"negative ttl", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{Ttl: durationpb.New(-time.Minute)})
			return r
		}, "ttl"},
		{"target host with a port", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com:443"})
			return r
		}, "target_host"},
		{"target host as a URL", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{TargetHost: "https://shop.example.com/"})
			return r
		}, "target_host"},
		{"empty label key", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{Selector: &leasev1.ProxySelector{Labels: map[string]string{"": "x"}}})
			return r
		}, `selector.labels[""]`},
		{"NUL in a selector zone", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{Selector: &leasev1.ProxySelector{Zone: "eu-1\x00"}})
			return r
		}, "selector.zone"},
		{"newline in a selector label value", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{Selector: &leasev1.ProxySelector{Labels: map[string]string{"pool": "eu\nx"}}})
			return r
		}, `selector.labels["pool"]`},
		{"session key too long", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{SessionKey: strings.Repeat("s", 129)})
			return r
		}, "session_key"},
		{"newline in a session key", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Acquire(ctx, &leasev1.AcquireLeaseRequest{SessionKey: "a\nb"})
			return r
		}, "session_key"},
		{"report target with a port", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: validID, Outcome: leasev1.Outcome_OUTCOME_BANNED, TargetHost: "shop.example.com:443"})
			return r
		}, "target_host"},
		{"NUL in a list filter", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.List(ctx, &leasev1.ListProxiesRequest{Selector: &leasev1.ProxySelector{Provider: "pve\x00"}})
			return r
		}, "selector.provider"},
		{"renew ttl too long", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Renew(ctx, &leasev1.RenewLeaseRequest{LeaseId: validID, Ttl: durationpb.New(48 * time.Hour)})
			return r
		}, "ttl"},
		{"lease id not a UUID", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Release(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: "lease-1"})
			return r
		}, "lease_id"},
		{"lease id missing", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Renew(ctx, &leasev1.RenewLeaseRequest{})
			return r
		}, "lease_id"},
		{"outcome unspecified", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: validID})
			return r
		}, "outcome"},
		{"outcome unknown", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: validID, Outcome: 42})
			return r
		}, "outcome"},
		{"negative cooldown", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: validID, Outcome: leasev1.Outcome_OUTCOME_BANNED, Cooldown: durationpb.New(-time.Second)})
			return r
		}, "cooldown"},
		{"cooldown too long", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: validID, Outcome: leasev1.Outcome_OUTCOME_BANNED, Cooldown: durationpb.New(30 * 24 * time.Hour)})
			return r
		}, "cooldown"},
		{"unknown scope", func(ctx context.Context, c lt.Client) lt.Result {
			_, r := c.Report(ctx, &leasev1.ReportOutcomeRequest{LeaseId: validID, Outcome: leasev1.Outcome_OUTCOME_BANNED, Scope: 9})
			return r
		}, "scope"},
	}
	forEachTransport(t, lt.Options{}, func(t *testing.T, env *lt.Env, c lt.Client) {
		env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				r := tc.call(lt.Ctx(t), c)
				wantCode(t, tc.name, r, codes.InvalidArgument, http.StatusBadRequest)
				if !strings.HasPrefix(r.Status.Message(), "invalid request: "+tc.field+": ") {
					t.Errorf("message %q does not name %s", r.Status.Message(), tc.field)
				}
				var named bool
				for _, d := range r.Status.Details() {
					if br, ok := d.(*errdetails.BadRequest); ok && len(br.GetFieldViolations()) == 1 && br.GetFieldViolations()[0].GetField() == tc.field {
						named = true
					}
				}
				if !named {
					t.Errorf("no BadRequest detail naming %s: %v", tc.field, r.Status.Details())
				}
			})
		}
		// Nothing was leased by the invalid calls.
		list, _ := c.List(lt.Ctx(t), &leasev1.ListProxiesRequest{})
		if got := list.GetProxies()[0].GetActiveLeases(); got != 0 {
			t.Errorf("active leases after invalid calls = %d", got)
		}
	})
}

func TestInvalidRESTBodies(t *testing.T) {
	t.Parallel()
	env := lt.Start(t, lt.Options{})
	env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
	token := lt.Tokens["crawler-a"]
	for _, tc := range []struct {
		name, path, body, field string
	}{
		{"not JSON", "/v1/leases", "{lease", "body"},
		{"unknown field", "/v1/leases", `{"targetHost":"a.example","colour":"red"}`, "colour"},
		{"wrong type", "/v1/leases", `{"ttl":42}`, "body"},
		{"bad duration", "/v1/leases", `{"ttl":"soon"}`, "body"},
		{"unknown outcome name", "/v1/leases/123e4567-e89b-42d3-a456-426614174000:report", `{"outcome":"OUTCOME_MEH"}`, "outcome"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, body, err := lt.Raw(lt.Ctx(t), http.MethodPost, "http://"+env.HTTPAddr+tc.path, token, []byte(tc.body))
			if err != nil || code != http.StatusBadRequest {
				t.Errorf("POST %s %s = %d %s, %v; want 400", tc.path, tc.body, code, body, err)
			}
			if !strings.Contains(string(body), `"message":"invalid request: `+tc.field+`: `) || !strings.Contains(string(body), `"field":"`+tc.field+`"`) {
				t.Errorf("POST %s %s: the error does not name %s: %s", tc.path, tc.body, tc.field, body)
			}
		})
	}
}

// A client over its lease rate limit is refused with RESOURCE_EXHAUSTED
// marked rate-limited, and over REST with 429 and Retry-After (not the 409
// of an exhausted pool); another client keeps its own budget.
func TestPerClientRateLimit(t *testing.T) {
	t.Parallel()
	env := lt.Start(t, lt.Options{Limits: auth.Limits{Lease: auth.RateLimit{Rate: 0.01, Burst: 3}}})
	env.Apply(t, lt.Proxy(uidA, "proxy-a", lt.MaxLeases(0)), 1)
	g := env.Client("grpc", "crawler-a")
	for i := range 3 {
		if _, r := g.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{}); r.Code() != codes.OK {
			t.Fatalf("acquire %d inside the burst: %v", i, r.Status)
		}
	}
	_, r := g.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{})
	if r.Code() != codes.ResourceExhausted || !auth.IsRateLimited(r.Status) {
		t.Errorf("over the limit over gRPC = %v, want RESOURCE_EXHAUSTED (rate limited)", r.Status)
	}
	code, body, err := lt.Raw(lt.Ctx(t), http.MethodPost, "http://"+env.HTTPAddr+"/v1/leases", lt.Tokens["crawler-a"], []byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	if code != http.StatusTooManyRequests || !strings.Contains(string(body), "rate limit") {
		t.Errorf("over the limit over REST = %d %s, want 429", code, body)
	}
	req, _ := http.NewRequest(http.MethodPost, "http://"+env.HTTPAddr+"/v1/leases", strings.NewReader(`{}`))
	req.Header.Set("Authorization", "Bearer "+lt.Tokens["crawler-a"])
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Errorf("429 without Retry-After: %d %v", resp.StatusCode, resp.Header)
	}
	if _, r := env.Client("grpc", "crawler-b").Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{}); r.Code() != codes.OK {
		t.Errorf("another client was limited too: %v", r.Status)
	}
	// Listing is not rate limited.
	if _, r := g.List(lt.Ctx(t), &leasev1.ListProxiesRequest{}); r.Code() != codes.OK {
		t.Errorf("listing after the limit: %v", r.Status)
	}
}

// TestSessions: a session's acquire answers its lease while its proxy can
// serve, and moves it (saying so) when the proxy cannot; a report names
// the target it saw. Over gRPC and REST.
func TestSessions(t *testing.T) {
	t.Parallel()
	forEachTransport(t, lt.Options{}, func(t *testing.T, env *lt.Env, c lt.Client) {
		env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
		env.Apply(t, lt.Proxy(uidB, "proxy-b"), 1)
		req := &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com", SessionKey: "crawl-1"}
		resp, r := c.Acquire(lt.Ctx(t), req)
		wantCode(t, "first session acquire", r, codes.OK, http.StatusOK)
		first := resp.GetLease()
		if resp.GetSession().GetResult() != leasev1.SessionResult_SESSION_RESULT_NEW || first.GetSessionKey() != "crawl-1" {
			t.Fatalf("first session acquire: %v, want a NEW session crawl-1", resp)
		}
		resp, r = c.Acquire(lt.Ctx(t), req)
		wantCode(t, "second session acquire", r, codes.OK, http.StatusOK)
		if resp.GetSession().GetResult() != leasev1.SessionResult_SESSION_RESULT_EXISTING || resp.GetLease().GetLeaseId() != first.GetLeaseId() {
			t.Fatalf("second session acquire: %v, want the EXISTING lease %s", resp, first.GetLeaseId())
		}
		// A plain acquire has no session in its answer.
		plain, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{})
		wantCode(t, "plain acquire", r, codes.OK, http.StatusOK)
		if plain.Session != nil || plain.GetLease().GetSessionKey() != "" {
			t.Fatalf("plain acquire: %v, want no session", plain)
		}
		if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: plain.GetLease().GetLeaseId()}); r.Code() != codes.OK {
			t.Fatal(r.Status)
		}
		// The session's proxy starts draining: the session moves.
		name := first.GetProxyName()
		drained := lt.Proxy(first.GetProxyUid(), name)
		drained.Draining = true
		env.Apply(t, drained, 2)
		resp, r = c.Acquire(lt.Ctx(t), req)
		wantCode(t, "session acquire after draining", r, codes.OK, http.StatusOK)
		s := resp.GetSession()
		if s.GetResult() != leasev1.SessionResult_SESSION_RESULT_MOVED || s.GetPreviousLeaseId() != first.GetLeaseId() ||
			s.GetPreviousProxyName() != name || s.GetMoveReason() != leasev1.SessionMoveReason_SESSION_MOVE_REASON_PROXY_DRAINING ||
			resp.GetLease().GetProxyName() == name {
			t.Fatalf("session acquire after draining %s: %v, want MOVED off it for draining", name, resp)
		}
		// A report for another target than the lease's cools that one.
		rep, r := c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: resp.GetLease().GetLeaseId(),
			Outcome: leasev1.Outcome_OUTCOME_BANNED, TargetHost: "News.Example.COM."})
		wantCode(t, "report for another target", r, codes.OK, http.StatusOK)
		if rep.GetCooldown().GetTargetHost() != "news.example.com" {
			t.Fatalf("report: %v, want a cooldown for news.example.com", rep)
		}
	})
}
