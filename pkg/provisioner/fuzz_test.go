package provisioner_test

import (
	"strings"
	"testing"
	"unicode"

	"google.golang.org/protobuf/proto"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
	"github.com/egress-proxies/egress-proxies/pkg/validate/validatetest"
)

// FuzzCreateInstanceRequest feeds the provisioner's requests as they
// arrive, over gRPC and inside a NATS Command, through the contract's
// rules: nothing panics, errors keep the one shape, and an accepted request
// carries no control character in its names and no NUL or escape in its
// cloud-init. Seeds: testdata/fuzz/FuzzCreateInstanceRequest.
func FuzzCreateInstanceRequest(f *testing.F) {
	v, err := validate.New()
	if err != nil {
		f.Fatal(err)
	}
	req := &provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: "6f1c1e8e-8c52-4a4e-9a57-0f7f0d1c2b3a", ProxyName: "p1",
		Placement: &proxyv1.Placement{Zone: "pve1", MachineType: "small", Image: "debian-12"}, CloudInit: "#cloud-config\n", Port: 3128, SpecHash: "abcd"}
	bin, _ := proto.Marshal(req)
	f.Add(bin, false)
	cmd, _ := proto.Marshal(&busv1.Command{CommandId: "c1", ProxyUid: req.ProxyUid, Provider: "pve", Request: &busv1.Command_Create{Create: req}})
	f.Add(cmd, true)
	f.Fuzz(func(t *testing.T, data []byte, asCommand bool) {
		var in *provisionerv1.CreateInstanceRequest
		if asCommand {
			var c busv1.Command
			if proto.Unmarshal(data, &c) != nil || c.GetCreate() == nil {
				return
			}
			in = c.GetCreate()
		} else {
			in = &provisionerv1.CreateInstanceRequest{}
			if proto.Unmarshal(data, in) != nil {
				return
			}
		}
		if err := v.Check(in); err != nil {
			if !validatetest.IsViolation(err) {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
		}
		p := in.GetPlacement()
		for _, s := range []string{in.GetProvider(), in.GetProxyUid(), in.GetProxyName(), in.GetSpecHash(), p.GetRegion(), p.GetZone(), p.GetMachineType(), p.GetImage()} {
			if strings.ContainsFunc(s, unicode.IsControl) {
				t.Fatalf("accepted a control character: %q", s)
			}
		}
		if strings.ContainsAny(in.GetCloudInit(), "\x00\x1b\x7f") || len(in.GetCloudInit()) > 64<<10 || in.GetPort() > 65535 {
			t.Fatalf("accepted cloud-init of %d bytes with a control character, or port %d", len(in.GetCloudInit()), in.GetPort())
		}
	})
}
