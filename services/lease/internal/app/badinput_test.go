package app_test

import (
	"strings"
	"testing"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	lt "github.com/egress-proxies/egress-proxies/services/lease/internal/leasetest"
)

// Every LeaseService endpoint over REST, fed malformed JSON, wrong types,
// huge bodies, control characters and out-of-range numbers: each answers
// its 4xx in the one error shape naming the field, and no lease or
// cooldown is written.
func TestRESTBadInput(t *testing.T) {
	t.Parallel()
	env := lt.Start(t, lt.Options{})
	env.Apply(t, lt.Proxy(uidA, "proxy-a"), 1)
	acq, r := env.Client("grpc", "crawler-a").Acquire(lt.Ctx(t), &leasev1.AcquireLeaseRequest{TargetHost: "shop.example"})
	if r.Code() != 0 {
		t.Fatalf("acquire: %v", r.Status)
	}
	id := acq.GetLease().GetLeaseId()
	unchanged := servicetest.Unchanged(t, env.Config.Database.URL, "the leases or cooldowns", `SELECT
		(SELECT string_agg(l::text, ';' ORDER BY l::text) FROM lease.leases l) || '|' ||
		coalesce((SELECT string_agg(c::text, ';') FROM lease.cooldowns c), '')`)

	huge := strings.Repeat("a", 2<<20)
	lease := "/v1/leases/" + id
	cases := []servicetest.BadInput{
		// ListProxies (leasable proxies)
		{Name: "list: NUL in the provider", Method: "GET", Path: "/v1/leasable-proxies?selector.provider=pve%00", Status: 400, Field: "selector.provider"},
		{Name: "list: newline in the zone", Method: "GET", Path: "/v1/leasable-proxies?selector.zone=a%0Ab", Status: 400, Field: "selector.zone"},
		{Name: "list: NUL in a label value", Method: "GET", Path: "/v1/leasable-proxies?selector.labels%5Bpool%5D=eu%00", Status: 400, Field: `selector.labels["pool"]`},
		{Name: "list: zone too long", Method: "GET", Path: "/v1/leasable-proxies?selector.zone=" + strings.Repeat("z", 300), Status: 400, Field: "selector.zone"},
		// AcquireLease
		{Name: "acquire: not JSON", Method: "POST", Path: "/v1/leases", Body: `{"targetHost":`, Status: 400, Field: "body"},
		{Name: "acquire: unknown field", Method: "POST", Path: "/v1/leases", Body: `{"colour":"red"}`, Status: 400, Field: "colour"},
		{Name: "acquire: ttl a number", Method: "POST", Path: "/v1/leases", Body: `{"ttl":30}`, Status: 400, Field: "body"},
		{Name: "acquire: ttl out of range", Method: "POST", Path: "/v1/leases", Body: `{"ttl":"315576000001s"}`, Status: 400},
		{Name: "acquire: ttl too long for the service", Method: "POST", Path: "/v1/leases", Body: `{"ttl":"86400s"}`, Status: 400, Field: "ttl"},
		{Name: "acquire: NUL in the target", Method: "POST", Path: "/v1/leases", Body: `{"targetHost":"shop\u0000.example"}`, Status: 400, Field: "target_host"},
		{Name: "acquire: URL as the target", Method: "POST", Path: "/v1/leases", Body: `{"targetHost":"https://shop.example/"}`, Status: 400, Field: "target_host"},
		{Name: "acquire: newline in the selector zone", Method: "POST", Path: "/v1/leases", Body: `{"selector":{"zone":"eu\n1"}}`, Status: 400, Field: "selector.zone"},
		{Name: "acquire: selector labels not an object", Method: "POST", Path: "/v1/leases", Body: `{"selector":{"labels":["a"]}}`, Status: 400},
		{Name: "acquire: 64 KiB target", Method: "POST", Path: "/v1/leases", Body: `{"targetHost":"` + strings.Repeat("a", 64<<10) + `"}`, Status: 400, Field: "target_host"},
		// Bodies over --max-request-bytes are refused while they are read.
		{Name: "acquire: 2 MiB body", Method: "POST", Path: "/v1/leases", Body: `{"targetHost":"` + huge + `"}`, Status: 413},
		{Name: "acquire: 6 MiB body", Method: "POST", Path: "/v1/leases", Body: `{"targetHost":"` + strings.Repeat(huge, 3) + `"}`, Status: 413},
		// RenewLease
		{Name: "renew: not a UUID", Method: "POST", Path: "/v1/leases/nope:renew", Body: `{}`, Status: 400, Field: "lease_id"},
		{Name: "renew: NUL in the id", Method: "POST", Path: "/v1/leases/" + id + "%00:renew", Body: `{}`, Status: 400, Field: "lease_id"},
		{Name: "renew: ttl negative", Method: "POST", Path: lease + ":renew", Body: `{"ttl":"-5s"}`, Status: 400, Field: "ttl"},
		{Name: "renew: not JSON", Method: "POST", Path: lease + ":renew", Body: `ttl=5s`, Status: 400, Field: "body"},
		// ReleaseLease
		{Name: "release: not a UUID", Method: "POST", Path: "/v1/leases/x:release", Body: `{}`, Status: 400, Field: "lease_id"},
		{Name: "release: body an array", Method: "POST", Path: lease + ":release", Body: `[]`, Status: 400, Field: "body"},
		// ReportOutcome
		{Name: "report: unknown outcome name", Method: "POST", Path: lease + ":report", Body: `{"outcome":"OUTCOME_MEH"}`, Status: 400, Field: "outcome"},
		{Name: "report: outcome number out of the enum", Method: "POST", Path: lease + ":report", Body: `{"outcome":99}`, Status: 400, Field: "outcome"},
		{Name: "report: outcome over int32", Method: "POST", Path: lease + ":report", Body: `{"outcome":99999999999}`, Status: 400},
		{Name: "report: scope out of the enum", Method: "POST", Path: lease + ":report", Body: `{"outcome":"OUTCOME_BANNED","scope":7}`, Status: 400, Field: "scope"},
		{Name: "report: cooldown too long", Method: "POST", Path: lease + ":report", Body: `{"outcome":"OUTCOME_BANNED","cooldown":"99999999s"}`, Status: 400, Field: "cooldown"},
		{Name: "report: cooldown a bool", Method: "POST", Path: lease + ":report", Body: `{"outcome":"OUTCOME_BANNED","cooldown":true}`, Status: 400},
		{Name: "report: wrong method", Method: "GET", Path: lease + ":report", Status: 405},
	}
	servicetest.CheckBadInput(t, "http://"+env.HTTPAddr, lt.Tokens["crawler-a"], cases)
	// The operators' reads, with a viewer's token.
	servicetest.CheckBadInput(t, "http://"+env.HTTPAddr, lt.ViewerToken, []servicetest.BadInput{
		{Name: "leases: NUL in the client", Method: "GET", Path: "/v1/leases?clientId=a%00", Status: 400, Field: "client_id"},
		{Name: "leases: upper-case pool", Method: "GET", Path: "/v1/leases?pool=Web", Status: 400, Field: "pool"},
		{Name: "leases: URL as the target", Method: "GET", Path: "/v1/leases?targetHost=https%3A%2F%2Fshop.example%2F", Status: 400, Field: "target_host"},
		{Name: "leases: page size 5000", Method: "GET", Path: "/v1/leases?pageSize=5000", Status: 400, Field: "page_size"},
		{Name: "leases: forged page token", Method: "GET", Path: "/v1/leases?pageToken=abc", Status: 400, Field: "page_token"},
		{Name: "cooldowns: bad proxy name", Method: "GET", Path: "/v1/cooldowns?proxyName=a_b", Status: 400, Field: "proxy_name"},
		{Name: "cooldowns: negative page size", Method: "GET", Path: "/v1/cooldowns?pageSize=-1", Status: 400, Field: "page_size"},
		{Name: "cooldowns: forged page token", Method: "GET", Path: "/v1/cooldowns?pageToken=%21%21", Status: 400, Field: "page_token"},
		{Name: "watch: wrong method", Method: "POST", Path: "/v1/leases:watch", Body: `{}`, Status: 405},
	})
	unchanged()
}
