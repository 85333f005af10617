package spec

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
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

// FuzzValidate feeds arbitrary CreateProxyRequests: validation never
// panics, and an accepted spec normalises idempotently to a stable hash.
func FuzzValidate(f *testing.F) {
	seed, _ := proto.Marshal(&proxyv1.CreateProxyRequest{Name: "p1", Labels: map[string]string{"a": "b"}, Spec: managedSpec()})
	f.Add(seed)
	ext, _ := proto.Marshal(&proxyv1.CreateProxyRequest{Name: "e", Spec: &proxyv1.ProxySpec{
		Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h.example", Port: 1}}})
	f.Add(ext)
	f.Fuzz(func(t *testing.T, data []byte) {
		var req proxyv1.CreateProxyRequest
		if proto.Unmarshal(data, &req) != nil {
			return
		}
		var v Violations
		ValidateName(&v, "name", req.GetName())
		ValidateLabels(&v, "labels", req.GetLabels())
		Validate(&v, req.GetSpec(), configured, []string{"pve"})
		if err := v.Err(); err != nil {
			if !strings.HasPrefix(err.Error(), "rpc error: code = InvalidArgument desc = invalid request: ") {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
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
