package validate

import (
	"testing"

	"buf.build/go/protovalidate"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// A Validator builds protovalidate's environment (1.3 MB of heap) on the
// first check of a contract message, and never for messages outside the
// contracts, such as the gRPC health check every service makes of itself
// at start.
func TestValidatorBuildsOnFirstContractCheck(t *testing.T) {
	t.Parallel()
	v, err := New()
	if err != nil {
		t.Fatal(err)
	}
	build := v.pv
	builds := 0
	v.pv = func() (protovalidate.Validator, error) {
		builds++
		return build()
	}
	if err := v.Check(&healthpb.HealthCheckRequest{}); err != nil || builds != 0 {
		t.Fatalf("health check: error %v, %d builds; want nil, 0", err, builds)
	}
	if err := v.Check(&proxyv1.GetProxyRequest{}); err == nil || builds != 1 {
		t.Fatalf("empty GetProxyRequest: error %v, %d builds; want a violation, 1 build", err, builds)
	}
}
