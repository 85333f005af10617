package app_test

import (
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

func scrape(t *testing.T, env *lt.Env) map[string]string {
	t.Helper()
	code, body, err := lt.Raw(lt.Ctx(t), http.MethodGet, "http://"+env.HTTPAddr+"/metrics", "", nil)
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET /metrics = %d, %v", code, err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(body), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		out[line[:i]] = line[i+1:]
	}
	return out
}

func TestMetrics(t *testing.T) {
	t.Parallel()
	env := lt.Start(t, lt.Options{})
	c := env.Client("grpc", "crawler-a")
	env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
	env.Apply(t, lt.Proxy(uidB, "proxy-b", func(p *proxyv1.Proxy) { p.Status.Healthy = false }), 2)

	l := mustAcquire(t, c, &leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com"})
	if _, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{}); r.Code() != codes.ResourceExhausted {
		t.Fatal(r.Status)
	}
	if _, r := c.Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{TargetHost: "bad host"}); r.Code() != codes.InvalidArgument {
		t.Fatal(r.Status)
	}
	before := scrape(t, env)
	if _, r := c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_BANNED}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	if _, r := c.Report(lt.Ctx(t), &leasev1.ReportOutcomeRequest{LeaseId: l.GetLeaseId(), Outcome: leasev1.Outcome_OUTCOME_TIMEOUT}); r.Code() != codes.OK {
		t.Fatal(r.Status)
	}
	for range 2 {
		if _, r := c.Release(lt.Ctx(t), &leasev1.ReleaseLeaseRequest{LeaseId: l.GetLeaseId()}); r.Code() != codes.OK {
			t.Fatal(r.Status)
		}
	}
	after := scrape(t, env)

	for _, tc := range []struct {
		m    map[string]string
		name string
		want string
	}{
		{before, `egress_lease_active_leases`, "1"},
		{after, `egress_lease_active_leases`, "0"},
		{after, `egress_lease_acquires_total{result="granted"}`, "1"},
		// One proxy unhealthy, one at capacity: a tie goes to the first
		// reason in field order.
		{after, `egress_lease_acquires_total{result="unhealthy"}`, "1"},
		{after, `egress_lease_acquires_total{result="at_capacity"}`, "0"},
		{after, `egress_lease_acquires_total{result="invalid_argument"}`, "1"},
		{after, `egress_lease_acquires_total{result="cooling_down_target"}`, "0"},
		{before, `egress_lease_active_cooldowns{scope="target"}`, "0"},
		{after, `egress_lease_active_cooldowns{scope="target"}`, "1"},
		{after, `egress_lease_active_cooldowns{scope="global"}`, "1"},
		{after, `egress_lease_reports_total{outcome="banned"}`, "1"},
		{after, `egress_lease_reports_total{outcome="timeout"}`, "1"},
		{after, `egress_lease_releases_total{result="released"}`, "1"},
		{after, `egress_lease_releases_total{result="already_ended"}`, "1"},
		{after, `egress_lease_proxies{state="leasable"}`, "1"},
		{after, `egress_lease_proxies{state="unavailable"}`, "1"},
		{after, `egress_lease_request_duration_seconds_count{code="OK",method="AcquireLease"}`, "1"},
		{after, `egress_lease_request_duration_seconds_count{code="ResourceExhausted",method="AcquireLease"}`, "1"},
		{after, `egress_lease_request_duration_seconds_count{code="OK",method="ReleaseLease"}`, "2"},
		{after, `egress_lease_stats_scrape_error`, "0"},
		// One call at a time: each granted acquire, report and release is
		// a round of its own; the refused acquire needed none.
		{after, `egress_lease_commit_round_operations_count`, "5"},
		{after, `egress_lease_commit_round_operations_sum`, "5"},
		{after, `egress_lease_commit_queued_operations`, "0"},
	} {
		if got := tc.m[tc.name]; got != tc.want {
			t.Errorf("%s = %q, want %s", tc.name, got, tc.want)
		}
	}
}
