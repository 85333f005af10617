package auth

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	// Every API of the suite registers its services with protoregistry.
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/gateway/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	_ "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// The policy, written out once more by hand: a change of the table must
// change this too, on purpose.
var wantMatrix = map[string]string{
	"/egress.proxy.v1.ProxyService/CreateProxy":                   "admin",
	"/egress.proxy.v1.ProxyService/UpdateProxy":                   "admin",
	"/egress.proxy.v1.ProxyService/DeleteProxy":                   "admin",
	"/egress.proxy.v1.ProxyService/GetProxy":                      "admin,viewer",
	"/egress.proxy.v1.ProxyService/ListProxies":                   "admin,viewer,service",
	"/egress.proxy.v1.ProxyService/WatchProxies":                  "admin,viewer,service",
	"/egress.proxy.v1.ProxyService/ListProviders":                 "admin,viewer",
	"/egress.proxy.v1.ProxyService/DrainProxy":                    "admin",
	"/egress.proxy.v1.ProxyService/ListProxyChanges":              "admin,viewer",
	"/egress.proxy.v1.ProxyService/RotateCredentials":             "admin",
	"/egress.proxy.v1.ProxyService/GetProxyCredentials":           "service",
	"/egress.proxy.v1.ProxyPoolService/CreateProxyPool":           "admin",
	"/egress.proxy.v1.ProxyPoolService/UpdateProxyPool":           "admin",
	"/egress.proxy.v1.ProxyPoolService/ScaleProxyPool":            "admin",
	"/egress.proxy.v1.ProxyPoolService/DeleteProxyPool":           "admin",
	"/egress.proxy.v1.ProxyPoolService/GetProxyPool":              "admin,viewer",
	"/egress.proxy.v1.ProxyPoolService/ListProxyPools":            "admin,viewer",
	"/egress.proxy.v1.ProxyPoolService/WatchProxyPools":           "admin,viewer",
	"/egress.lease.v1.LeaseService/ListProxies":                   "admin,viewer,crawler",
	"/egress.lease.v1.LeaseService/AcquireLease":                  "admin,crawler,service",
	"/egress.lease.v1.LeaseService/RenewLease":                    "admin,crawler,service",
	"/egress.lease.v1.LeaseService/ReleaseLease":                  "admin,crawler,service",
	"/egress.lease.v1.LeaseService/ReportOutcome":                 "admin,crawler,service",
	"/egress.lease.v1.LeaseService/ListLeases":                    "admin,viewer",
	"/egress.lease.v1.LeaseService/ListCooldowns":                 "admin,viewer,service",
	"/egress.lease.v1.LeaseService/WatchLeases":                   "admin,viewer,service",
	"/egress.identity.v1.IdentityService/GetIdentity":             "admin,viewer,crawler,service",
	"/egress.gateway.v1.GatewayService/ListSessions":              "admin,viewer,crawler",
	"/egress.gateway.v1.GatewayService/GetSession":                "admin,viewer,crawler",
	"/egress.gateway.v1.GatewayService/EndSession":                "admin,crawler",
	"/egress.gateway.v1.GatewayService/ReportOutcome":             "admin,crawler",
	"/egress.gateway.v1.GatewayService/GetStatus":                 "admin,viewer,crawler,service",
	"/egress.health.v1.HealthService/GetProxyHealth":              "admin,viewer",
	"/egress.health.v1.HealthService/ListProxyHealth":             "admin,viewer",
	"/egress.health.v1.HealthService/WatchProxyHealth":            "admin,viewer",
	"/egress.health.v1.HealthService/GetProviderHealth":           "admin,viewer",
	"/egress.health.v1.HealthService/ListProviderHealth":          "admin,viewer,service",
	"/egress.provisioner.v1.ProvisionerService/CreateInstance":    "service",
	"/egress.provisioner.v1.ProvisionerService/GetInstance":       "service",
	"/egress.provisioner.v1.ProvisionerService/DeleteInstance":    "service",
	"/egress.provisioner.v1.ProvisionerService/ListInstances":     "service",
	"/egress.provisioner.v1.ProvisionerService/CheckBackend":      "service",
	"/egress.provisioner.v1.ProvisionerService/UpdateCredentials": "service",
}

func TestTableIsThePolicy(t *testing.T) {
	t.Parallel()
	if got := Methods(); !slices.Equal(got, sortedKeys(wantMatrix)) {
		t.Errorf("table methods = %v\nwant %v", got, sortedKeys(wantMatrix))
	}
	for method, want := range wantMatrix {
		for _, role := range AllRoles() {
			allowed := slices.Contains(strings.Split(want, ","), string(role))
			if got := Allowed(method, []Role{role}); got != allowed {
				t.Errorf("Allowed(%s, %s) = %v, want %v", method, role, got, allowed)
			}
		}
	}
	if Allowed("/egress.proxy.v1.ProxyService/Nope", AllRoles()) {
		t.Error("a method missing from the table is allowed")
	}
}

// Every RPC of every gRPC service the suite defines is in the table: a new
// RPC without a rule fails here (and its service would refuse to start).
func TestEveryRPCIsInTheTable(t *testing.T) {
	t.Parallel()
	n := 0
	protoregistry.GlobalFiles.RangeFiles(func(fd protoreflect.FileDescriptor) bool {
		if !strings.HasPrefix(string(fd.Package()), "egress.") {
			return true
		}
		for i := range fd.Services().Len() {
			sd := fd.Services().Get(i)
			for j := range sd.Methods().Len() {
				full := "/" + string(sd.FullName()) + "/" + string(sd.Methods().Get(j).Name())
				n++
				if _, ok := RuleFor(full); !ok {
					t.Errorf("%s is not in the role table", full)
				}
			}
		}
		return true
	})
	if n != len(wantMatrix) {
		t.Errorf("the suite defines %d RPCs; the expected matrix lists %d", n, len(wantMatrix))
	}
}

func sortedKeys(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func TestParseRoles(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in   string
		want []Role
		err  bool
	}{
		{"admin", []Role{Admin}, false},
		{"crawler,viewer", []Role{Crawler, Viewer}, false},
		{"viewer,viewer", []Role{Viewer}, false},
		{"service", []Role{Service}, false},
		{"Admin", nil, true},
		{"", nil, true},
		{"admin,", nil, true},
		{"root", nil, true},
	}
	for _, tc := range cases {
		got, err := ParseRoles(tc.in)
		if (err != nil) != tc.err || !slices.Equal(got, tc.want) {
			t.Errorf("ParseRoles(%q) = %v, %v; want %v (error %v)", tc.in, got, err, tc.want, tc.err)
		}
	}
}

func TestLimitsValidate(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		l  Limits
		ok bool
	}{
		"defaults":       {DefaultLimits(), true},
		"off":            {Limits{}, true},
		"negative rate":  {Limits{Lease: RateLimit{Rate: -1, Burst: 1}}, false},
		"no burst":       {Limits{ProxyWrites: RateLimit{Rate: 1}}, false},
		"burst, no rate": {Limits{Lease: RateLimit{Burst: 3}}, true},
	}
	for name, tc := range cases {
		if err := tc.l.Validate(); (err == nil) != tc.ok {
			t.Errorf("%s: Validate = %v", name, err)
		}
	}
}

// Buckets are per client and per class; a refusal is RESOURCE_EXHAUSTED
// with a retry delay the client can act on, and refills with time.
func TestRateLimits(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_700_000_000, 0)
	l := &limiters{cfg: Limits{Lease: RateLimit{Rate: 1, Burst: 2}, ProxyWrites: RateLimit{Rate: 0.5, Burst: 1}},
		now: func() time.Time { return now }, buckets: map[limiterKey]*rate.Limiter{}}
	ctx := context.Background()
	for i := range 2 {
		if err := l.allow(ctx, LeaseLimit, "a"); err != nil {
			t.Fatalf("call %d inside the burst: %v", i, err)
		}
	}
	err := l.allow(ctx, LeaseLimit, "a")
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted || !IsRateLimited(st) {
		t.Fatalf("third call = %v, want RESOURCE_EXHAUSTED marked rate-limited", err)
	}
	var retry *errdetails.RetryInfo
	for _, d := range st.Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			retry = r
		}
	}
	if retry.GetRetryDelay().AsDuration() != time.Second || !strings.Contains(st.Message(), "retry in 1s") {
		t.Errorf("retry info = %v, message %q; want 1s", retry, st.Message())
	}
	if err := l.allow(ctx, LeaseLimit, "b"); err != nil {
		t.Errorf("another client shares the bucket: %v", err)
	}
	if err := l.allow(ctx, ProxyWriteLimit, "a"); err != nil {
		t.Errorf("another class shares the bucket: %v", err)
	}
	if err := l.allow(ctx, NoLimit, "a"); err != nil {
		t.Errorf("an unlimited method was limited: %v", err)
	}
	if err := l.allow(ctx, ProxyWriteLimit, "a"); !IsRateLimited(status.Convert(err)) || !strings.Contains(err.Error(), "retry in 2s") {
		t.Errorf("second write at 0.5/s = %v, want a 2s retry", err)
	}
	now = now.Add(time.Second)
	if err := l.allow(ctx, LeaseLimit, "a"); err != nil {
		t.Errorf("after a second the bucket has refilled one call: %v", err)
	}
	if IsRateLimited(status.New(codes.ResourceExhausted, "no proxy available")) {
		t.Error("a plain RESOURCE_EXHAUSTED counts as rate-limited")
	}
}
