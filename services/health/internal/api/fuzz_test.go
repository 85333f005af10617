package api

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
	"github.com/egress-proxies/egress-proxies/pkg/validate/validatetest"
)

// FuzzListProxyHealthRequest feeds ListProxyHealthRequests, as protobuf and
// as the JSON the REST layer decodes, through the contract's rules and
// the page-token decoding: nothing panics, errors keep the one shape naming
// their field, and a token this service issues decodes back to where it
// stopped. Seeds: testdata/fuzz/FuzzListProxyHealthRequest.
func FuzzListProxyHealthRequest(f *testing.F) {
	v, err := validate.New()
	if err != nil {
		f.Fatal(err)
	}
	bin, _ := proto.Marshal(&healthv1.ListProxyHealthRequest{PageSize: 10, PageToken: encodePageToken("proxy-1", "u1")})
	f.Add(bin, false)
	f.Add([]byte(`{"pageSize":5,"pageToken":"cHJveHktMQB1MQ"}`), true)
	f.Fuzz(func(t *testing.T, data []byte, asJSON bool) {
		var req healthv1.ListProxyHealthRequest
		if !validatetest.Decode(data, asJSON, &req) {
			return
		}
		if err := v.Check(&req); err != nil {
			if !validatetest.IsViolation(err) {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
		}
		if req.GetPageSize() < 0 {
			t.Fatalf("accepted page size %d", req.GetPageSize())
		}
		name, uid, err := decodePageToken(req.GetPageToken())
		if err != nil {
			if !strings.Contains(err.Error(), "invalid request: page_token: ") {
				t.Fatalf("unexpected error shape: %v", err)
			}
			return
		}
		if req.GetPageToken() != "" && !strings.Contains(uid, "\x00") {
			n2, u2, err := decodePageToken(encodePageToken(name, uid))
			if err != nil || n2 != name || u2 != uid {
				t.Fatalf("token round trip: %q/%q -> %q/%q (%v)", name, uid, n2, u2, err)
			}
		}
	})
}
