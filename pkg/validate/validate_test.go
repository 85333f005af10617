package validate_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
)

func newValidator(t testing.TB) *validate.Validator {
	t.Helper()
	v, err := validate.New()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func managed() *proxyv1.ProxySpec {
	return &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve",
		Placement: &proxyv1.Placement{Zone: "pve1", MachineType: "small", Image: "debian-12"}, CloudInit: "#cloud-config\nruncmd:\n\t- true\r\n"}
}

// violations returns the BadRequest field names of err, or fails.
func violations(t *testing.T, err error) []string {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.InvalidArgument {
		t.Fatalf("err = %v, want INVALID_ARGUMENT", err)
	}
	var fields []string
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, fv := range br.GetFieldViolations() {
				if fv.GetDescription() == "" {
					t.Errorf("violation of %s has no description", fv.GetField())
				}
				fields = append(fields, fv.GetField())
			}
		}
	}
	if len(fields) == 0 {
		t.Fatalf("no google.rpc.BadRequest in %v", st.Proto())
	}
	return fields
}

func TestCheck(t *testing.T) {
	t.Parallel()
	v := newValidator(t)
	ok := []proto.Message{
		&proxyv1.CreateProxyRequest{Name: "p-1", Labels: map[string]string{"example.com/team": "crawl_1"}, Spec: managed()},
		&proxyv1.ListProxiesRequest{Provider: "pve", PageSize: 1000, Labels: map[string]string{"a": ""}},
		&proxyv1.GetProxyRequest{Name: "a"},
		&leasev1.AcquireLeaseRequest{TargetHost: "shop.example.com", Selector: &leasev1.ProxySelector{Zone: "europe-west1-b", Labels: map[string]string{"k": "v"}}},
		&leasev1.RenewLeaseRequest{LeaseId: "123e4567-e89b-12d3-a456-426614174000"},
		&healthv1.ListProxyHealthRequest{PageSize: 5000},
		&provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "prod-1", ProxyUid: "u1", CloudInit: "#!/bin/sh\necho ok\n", Port: 3128},
		&provisionerv1.ListInstancesRequest{Provider: "pve", Installation: "prod-1"},
	}
	for _, m := range ok {
		if err := v.Check(m); err != nil {
			t.Errorf("Check(%T %v) = %v, want nil", m, m, err)
		}
	}

	zone := func(z string) *proxyv1.CreateProxyRequest {
		s := managed()
		s.Placement.Zone = z
		return &proxyv1.CreateProxyRequest{Name: "p", Spec: s}
	}
	cases := []struct {
		name  string
		msg   proto.Message
		field string
	}{
		{"NUL in a placement zone", zone("pve1\x00"), "spec.placement.zone"},
		{"newline in a placement zone", zone("pve1\nx"), "spec.placement.zone"},
		{"tab in a placement zone", zone("a\tb"), "spec.placement.zone"},
		{"bidi override in a placement zone", zone("a\u202eb"), "spec.placement.zone"},
		{"line separator in a placement zone", zone("a\u2028b"), "spec.placement.zone"},
		{"C1 control in a placement zone", zone("a\u0085b"), "spec.placement.zone"},
		{"zone too long", zone(strings.Repeat("z", 254)), "spec.placement.zone"},
		{"NUL in a list filter", &proxyv1.ListProxiesRequest{Provider: "pve\x00"}, "provider"},
		{"no installation", &provisionerv1.ListInstancesRequest{Provider: "pve"}, "installation"},
		{"no installation on a delete", &provisionerv1.DeleteInstanceRequest{Provider: "pve", ProviderId: "vms/1/x", ProxyUid: "u"}, "installation"},
		{"upper-case installation", &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "Prod"}, "installation"},
		{"installation too long", &provisionerv1.CreateInstanceRequest{Provider: "pve", ProxyUid: "u", Installation: strings.Repeat("a", 33)}, "installation"},
		{"NUL in a watch filter", &proxyv1.WatchProxiesRequest{Provider: "\x00"}, "provider"},
		{"unknown phase filter", &proxyv1.ListProxiesRequest{Phase: 42}, "phase"},
		{"page size over 1000", &proxyv1.ListProxiesRequest{PageSize: 1001}, "page_size"},
		{"negative page size", &proxyv1.ListProxiesRequest{PageSize: -1}, "page_size"},
		{"label filter key", &proxyv1.ListProxiesRequest{Labels: map[string]string{"a\x00": "b"}}, `labels["a\x00"]`},
		{"label value", &proxyv1.CreateProxyRequest{Name: "p", Spec: managed(), Labels: map[string]string{"a": "b c"}}, `labels["a"]`},
		{"upper-case name", &proxyv1.CreateProxyRequest{Name: "P", Spec: managed()}, "name"},
		{"no spec", &proxyv1.CreateProxyRequest{Name: "p"}, "spec"},
		{"no mode", &proxyv1.CreateProxyRequest{Name: "p", Spec: &proxyv1.ProxySpec{}}, "spec.mode"},
		{"undefined mode", &proxyv1.CreateProxyRequest{Name: "p", Spec: &proxyv1.ProxySpec{Mode: 9}}, "spec.mode"},
		{"NUL in cloud-init", func() proto.Message {
			s := managed()
			s.CloudInit = "a\x00"
			return &proxyv1.CreateProxyRequest{Name: "p", Spec: s}
		}(), "spec.cloud_init"},
		{"ESC in cloud-init", func() proto.Message {
			s := managed()
			s.CloudInit = "a\x1b[0m"
			return &proxyv1.CreateProxyRequest{Name: "p", Spec: s}
		}(), "spec.cloud_init"},
		{"cloud-init over 64 KiB", func() proto.Message {
			s := managed()
			s.CloudInit = strings.Repeat("x", 64<<10+1)
			return &proxyv1.CreateProxyRequest{Name: "p", Spec: s}
		}(), "spec.cloud_init"},
		{"port over 65535", func() proto.Message {
			s := managed()
			s.Port = 65536
			return &proxyv1.CreateProxyRequest{Name: "p", Spec: s}
		}(), "spec.port"},
		{"endpoint port 0", &proxyv1.CreateProxyRequest{Name: "p", Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h"}}}, "spec.endpoint.port"},
		{"negative since_revision", &proxyv1.WatchProxiesRequest{SinceRevision: -1}, "since_revision"},
		{"lease id not a UUID", &leasev1.ReleaseLeaseRequest{LeaseId: "nope"}, "lease_id"},
		{"undefined outcome", &leasev1.ReportOutcomeRequest{LeaseId: "123e4567-e89b-12d3-a456-426614174000", Outcome: 99}, "outcome"},
		{"newline in a selector zone", &leasev1.AcquireLeaseRequest{Selector: &leasev1.ProxySelector{Zone: "a\nb"}}, "selector.zone"},
		{"NUL in a target host", &leasev1.AcquireLeaseRequest{TargetHost: "a\x00"}, "target_host"},
		{"empty health proxy name", &healthv1.GetProxyHealthRequest{}, "proxy_name"},
		{"negative health sequence", &healthv1.WatchProxyHealthRequest{SinceSequence: -1}, "since_sequence"},
		{"NUL in a provisioner provider", &provisionerv1.DeleteInstanceRequest{Provider: "a\x00"}, "provider"},
		{"NUL in provisioner cloud-init", &provisionerv1.CreateInstanceRequest{CloudInit: "\x00"}, "cloud_init"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := v.Check(tc.msg)
			fields := violations(t, err)
			found := false
			for _, f := range fields {
				found = found || f == tc.field
			}
			if !found {
				t.Errorf("violations name %v, want %q", fields, tc.field)
			}
			if !strings.Contains(status.Convert(err).Message(), tc.field) {
				t.Errorf("message %q does not name %s", status.Convert(err).Message(), tc.field)
			}
		})
	}
}

// A violation never echoes the value: cloud-init is a secret.
func TestCheckDoesNotEchoValues(t *testing.T) {
	t.Parallel()
	v := newValidator(t)
	s := managed()
	s.CloudInit = "password: hunter2-secret\x00"
	err := v.Check(&proxyv1.CreateProxyRequest{Name: "p", Spec: s})
	st := status.Convert(err)
	if st.Code() != codes.InvalidArgument {
		t.Fatalf("err = %v", err)
	}
	b, _ := proto.Marshal(st.Proto())
	if strings.Contains(string(b), "hunter2") {
		t.Errorf("the status carries the cloud-init: %v", st.Proto())
	}
}

func TestViolationsErr(t *testing.T) {
	t.Parallel()
	var v validate.Violations
	if v.Err() != nil {
		t.Fatal("no violations must be nil")
	}
	v.Add("spec.provider", "%q is not configured", "x")
	v.Add("generation", "one of generation or etag is required")
	err := v.Err()
	if got := violations(t, err); strings.Join(got, ",") != "spec.provider,generation" {
		t.Errorf("fields = %v", got)
	}
	if msg := status.Convert(err).Message(); msg != `invalid request: spec.provider: "x" is not configured; generation: one of generation or etag is required` {
		t.Errorf("message = %q", msg)
	}
	if got := violations(t, validate.Field("f", "bad %d", 1)); got[0] != "f" {
		t.Errorf("Field: %v", got)
	}
}

// The unary interceptor answers before the handler runs. (The streaming one
// is exercised over real gRPC streams by the services' tests.)
func TestInterceptors(t *testing.T) {
	t.Parallel()
	v := newValidator(t)
	called := false
	_, err := v.UnaryServerInterceptor()(context.Background(), &proxyv1.GetProxyRequest{Name: "Bad Name"}, nil,
		func(context.Context, any) (any, error) { called = true; return nil, nil })
	if called || status.Code(err) != codes.InvalidArgument {
		t.Errorf("unary: handler called %v, err %v", called, err)
	}
	_, err = v.UnaryServerInterceptor()(context.Background(), &proxyv1.GetProxyRequest{Name: "good"}, nil,
		func(context.Context, any) (any, error) { called = true; return nil, nil })
	if !called || err != nil {
		t.Errorf("unary valid: handler called %v, err %v", called, err)
	}
}

// The multiline_text rule refuses exactly the characters the regular
// expression it replaced refused ([\x00-\x08\x0B\x0C\x0E-\x1F\x7F\x{80}-\x{9F}]),
// checked for every code point up to U+07FF (all one- and two-byte UTF-8
// sequences) and for the separators and format characters beyond, which
// it allows (printable refuses those), alone, in the middle of a text and
// at its ends.
func TestMultilineTextRuleIsTheRegexpItReplaced(t *testing.T) {
	t.Parallel()
	v := newValidator(t)
	old := regexp.MustCompile(`[\x00-\x08\x0B\x0C\x0E-\x1F\x7F\x{80}-\x{9F}]`)
	runes := []rune{0x2028, 0x2029, 0x200B, 0x202E, 0xFEFF, 0xFFFD, 0x10FFFF}
	for r := rune(0); r < 0x800; r++ {
		runes = append(runes, r)
	}
	for _, r := range runes {
		for _, text := range []string{string(r), "#cloud-config\n" + string(r) + "x", "x" + string(r)} {
			err := v.Check(&provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: "u1", CloudInit: text, Port: 3128})
			if refused, want := err != nil, old.MatchString(text); refused != want {
				t.Errorf("U+%04X in %q: refused %v, the regular expression %v (%v)", r, text, refused, want, err)
			}
		}
	}
}

// BenchmarkCheckCreateProxy is the validation cost of one CreateProxy by
// the size of its cloud-init (figures in docs/api.md, "Validation").
func BenchmarkCheckCreateProxy(b *testing.B) {
	v := newValidator(b)
	for _, lines := range []int{0, 50, 3000} { // 0, ~1 KiB, ~57 KiB
		b.Run(fmt.Sprintf("cloud-init=%dB", lines*19), func(b *testing.B) {
			req := &proxyv1.CreateProxyRequest{Name: "p-1", Labels: map[string]string{"example.com/team": "crawl"}, Spec: managed()}
			req.Spec.CloudInit = strings.Repeat("#cloud-config line\n", lines)
			for b.Loop() {
				if err := v.Check(req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
