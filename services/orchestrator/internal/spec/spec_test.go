package spec

import (
	"strings"
	"testing"
	"unicode"

	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
	"github.com/egress-proxies/egress-proxies/pkg/validate/validatetest"
)

func configured(p string) bool { return p == "pve" }

func managedSpec() *proxyv1.ProxySpec {
	return &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve",
		Placement: &proxyv1.Placement{Zone: "pv1-1", MachineType: "small", Image: "debian"}}
}

func TestHashCoversTheInstanceShapeOnly(t *testing.T) {
	t.Parallel()
	base := Hash(Normalize(managedSpec()))
	shape := map[string]func(*proxyv1.ProxySpec){
		"provider":   func(s *proxyv1.ProxySpec) { s.Provider = "gcp" },
		"region":     func(s *proxyv1.ProxySpec) { s.Placement.Region = "eu" },
		"zone":       func(s *proxyv1.ProxySpec) { s.Placement.Zone = "pv1-2" },
		"machine":    func(s *proxyv1.ProxySpec) { s.Placement.MachineType = "large" },
		"image":      func(s *proxyv1.ProxySpec) { s.Placement.Image = "ubuntu" },
		"cloud-init": func(s *proxyv1.ProxySpec) { s.CloudInit = "#cloud-config\n" },
		"port":       func(s *proxyv1.ProxySpec) { s.Port = 8080 },
	}
	for name, mut := range shape {
		s := managedSpec()
		mut(s)
		if Hash(Normalize(s)) == base {
			t.Errorf("changing %s does not change the hash", name)
		}
	}
	notShape := managedSpec()
	max := uint32(4)
	notShape.Lease = &proxyv1.LeaseSpec{MaxLeases: &max}
	notShape.HealthCheck = &proxyv1.HealthCheckSpec{SuccessThreshold: 3}
	if Hash(Normalize(notShape)) != base {
		t.Error("lease or health settings changed the hash; they must not replace the instance")
	}
	explicit := managedSpec()
	explicit.Port = DefaultPort
	if Hash(Normalize(explicit)) != base {
		t.Error("port 0 and the default port must hash alike")
	}
}

// FuzzValidate feeds arbitrary CreateProxyRequests, in the protobuf
// encoding gRPC clients send and in the JSON the REST layer decodes,
// through the whole validation a create gets (the contract's rules, then
// these Go checks): it never panics, whatever it accepts holds no control
// character, and an accepted spec normalises idempotently to a stable hash.
// Seeds: testdata/fuzz/FuzzValidate.
func FuzzValidate(f *testing.F) {
	v, err := validate.New()
	if err != nil {
		f.Fatal(err)
	}
	seed, _ := proto.Marshal(&proxyv1.CreateProxyRequest{Name: "p1", Labels: map[string]string{"a": "b"}, Spec: managedSpec()})
	f.Add(seed, false)
	ext, _ := proto.Marshal(&proxyv1.CreateProxyRequest{Name: "e", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h.example", Port: 1}}})
	f.Add(ext, false)
	f.Add([]byte(`{"name":"p1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"pve","placement":{"zone":"pv1-1"},"cloudInit":"#cloud-config\n"}}`), true)
	f.Add([]byte(`{"name":"p1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"pve","placement":{"zone":"pv1\u0000"}}}`), true)
	f.Fuzz(func(t *testing.T, data []byte, asJSON bool) {
		var req proxyv1.CreateProxyRequest
		if !validatetest.Decode(data, asJSON, &req) {
			return
		}
		if err := v.Check(&req); err != nil {
			if !validatetest.IsViolation(err) {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
		}
		var viol Violations
		ValidateLabels(&viol, "labels", req.GetLabels())
		Validate(&viol, req.GetSpec(), configured, []string{"pve"})
		if err := viol.Err(); err != nil {
			if !validatetest.IsViolation(err) {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
		}
		p := req.GetSpec().GetPlacement()
		for _, s := range []string{req.GetName(), req.GetSpec().GetProvider(), p.GetRegion(), p.GetZone(), p.GetMachineType(), p.GetImage(), req.GetSpec().GetEndpoint().GetHost()} {
			if strings.ContainsFunc(s, unicode.IsControl) {
				t.Fatalf("accepted a control character: %q", s)
			}
		}
		for k, val := range req.GetLabels() {
			if strings.ContainsFunc(k+val, unicode.IsControl) {
				t.Fatalf("accepted a control character in label %q=%q", k, val)
			}
		}
		if strings.ContainsAny(req.GetSpec().GetCloudInit(), "\x00\x1b\x7f") {
			t.Fatalf("accepted a control character in cloud-init")
		}
		n := Normalize(req.GetSpec())
		if !proto.Equal(n, Normalize(n)) {
			t.Fatal("Normalize is not idempotent")
		}
		if Hash(n) != Hash(Normalize(n)) {
			t.Fatal("hash not stable")
		}
	})
}
