package main

import (
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/store/storetest"
)

// Every HealthService endpoint over REST, fed control characters, wrong
// types and out-of-range numbers: each answers its 4xx in the one error
// shape naming the field, the health tables are unchanged, and nothing is
// logged at ERROR.
func TestRESTBadInput(t *testing.T) {
	t.Parallel()
	dsn, _ := storetest.New(t)
	proc, addrs := servicetest.Start(t, ".", []string{
		"--database-url=" + dsn, "--nats-url=" + natstest.New(t).URL(),
		"--probe-target=https://127.0.0.1:9/", "--auth-disabled", "--provider-check-interval=0",
	})
	unchanged := servicetest.Unchanged(t, dsn, "the health tables", `SELECT concat_ws('|',
		(SELECT count(*) FROM health.transitions), (SELECT count(*) FROM health.proxy_health),
		(SELECT count(*) FROM health.provider_health))`)
	cases := []servicetest.BadInput{
		{Name: "get: NUL in the name", Method: "GET", Path: "/v1/health/proxies/p%00", Status: 400, Field: "proxy_name"},
		{Name: "get: newline in the name", Method: "GET", Path: "/v1/health/proxies/p%0Aq", Status: 400, Field: "proxy_name"},
		{Name: "get: name too long", Method: "GET", Path: "/v1/health/proxies/" + strings.Repeat("p", 300), Status: 400, Field: "proxy_name"},
		{Name: "list: negative page size", Method: "GET", Path: "/v1/health/proxies?pageSize=-1", Status: 400, Field: "page_size"},
		{Name: "list: page size not a number", Method: "GET", Path: "/v1/health/proxies?pageSize=many", Status: 400, Field: "page_size"},
		{Name: "list: page size over int32", Method: "GET", Path: "/v1/health/proxies?pageSize=4294967296", Status: 400, Field: "page_size"},
		{Name: "list: NUL in the page token", Method: "GET", Path: "/v1/health/proxies?pageToken=%00", Status: 400, Field: "page_token"},
		{Name: "list: forged page token", Method: "GET", Path: "/v1/health/proxies?pageToken=bm9wZQ", Status: 400, Field: "page_token"},
		{Name: "watch: negative sequence", Method: "GET", Path: "/v1/health/proxies:watch?sinceSequence=-1", Status: 400, Field: "since_sequence"},
		{Name: "watch: sequence not a number", Method: "GET", Path: "/v1/health/proxies:watch?sinceSequence=x", Status: 400, Field: "since_sequence"},
		{Name: "provider: NUL in the name", Method: "GET", Path: "/v1/health/providers/pve%00", Status: 400, Field: "provider"},
		{Name: "provider: tab in the name", Method: "GET", Path: "/v1/health/providers/a%09b", Status: 400, Field: "provider"},
		{Name: "providers: wrong method", Method: "POST", Path: "/v1/health/providers", Body: `{}`, Status: 405},
	}
	servicetest.CheckBadInput(t, "http://"+addrs.HTTP, "", cases)
	unchanged()
	servicetest.NoErrorLogs(t, proc)
}
