package api

import (
	"strings"
	"testing"
	"unicode"

	"google.golang.org/protobuf/proto"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
	"github.com/egress-proxies/egress-proxies/pkg/validate/validatetest"
)

// FuzzAcquireRequest feeds AcquireLeaseRequests, in the protobuf encoding
// of gRPC and the JSON the REST layer decodes, through the whole
// validation an acquire gets (the contract's rules, then the Go checks):
// nothing panics, errors keep the one shape, and whatever is accepted holds
// no control character and a target host already in its canonical form.
// Seeds: testdata/fuzz/FuzzAcquireRequest.
func FuzzAcquireRequest(f *testing.F) {
	v, err := validate.New()
	if err != nil {
		f.Fatal(err)
	}
	bin, _ := proto.Marshal(&leasev1.AcquireLeaseRequest{TargetHost: "Shop.Example.COM.", Selector: &leasev1.ProxySelector{Zone: "eu-1", Labels: map[string]string{"pool": "a"}}})
	f.Add(bin, false)
	f.Add([]byte(`{"targetHost":"[::1]","ttl":"30s","selector":{"provider":"pve","labels":{"k":"v"}}}`), true)
	f.Fuzz(func(t *testing.T, data []byte, asJSON bool) {
		var req leasev1.AcquireLeaseRequest
		if !validatetest.Decode(data, asJSON, &req) {
			return
		}
		if err := v.Check(&req); err != nil {
			if !validatetest.IsViolation(err) {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
		}
		host, err := targetHost(req.GetTargetHost())
		if err != nil {
			if !strings.HasPrefix(err.Error(), "rpc error: code = InvalidArgument desc = invalid request: target_host: ") {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
		}
		again, err := targetHost(host)
		if err != nil || again != host {
			t.Fatalf("target host %q canonicalises to %q, then to %q (%v)", req.GetTargetHost(), host, again, err)
		}
		sel, _ := selector(req.GetSelector())
		for _, s := range []string{host, sel.Provider, sel.Region, sel.Zone} {
			if strings.ContainsFunc(s, unicode.IsControl) {
				t.Fatalf("accepted a control character: %q", s)
			}
		}
		for k, val := range sel.Labels {
			if strings.ContainsFunc(k+val, unicode.IsControl) {
				t.Fatalf("accepted a control character in label %q=%q", k, val)
			}
		}
	})
}

// FuzzLeaseID: a lease id the contract accepts is canonicalised stably, and
// nothing else gets through.
func FuzzLeaseID(f *testing.F) {
	v, err := validate.New()
	if err != nil {
		f.Fatal(err)
	}
	f.Add("123e4567-e89b-12d3-a456-426614174000")
	f.Add("123E4567-E89B-12D3-A456-426614174000")
	f.Add("{123e4567-e89b-12d3-a456-426614174000}")
	f.Fuzz(func(t *testing.T, id string) {
		req := &leasev1.ReleaseLeaseRequest{LeaseId: id}
		if proto.Unmarshal(mustMarshal(t, req), req) != nil {
			return // not UTF-8: gRPC would refuse it before any handler
		}
		if v.Check(req) != nil {
			return
		}
		canon, err := leaseID(id)
		if err != nil {
			return
		}
		if again, err := leaseID(canon); err != nil || again != canon || len(canon) != 36 {
			t.Fatalf("lease id %q -> %q -> %q (%v)", id, canon, again, err)
		}
	})
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Skip("not encodable")
	}
	return b
}
