package main

import (
	"crypto/rand"
	"encoding/base64"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// Every ProxyService endpoint over REST, fed malformed JSON, wrong types,
// huge bodies, control characters and out-of-range numbers: each answers
// its 4xx in the one error shape naming the field, nothing is written, and
// nothing is logged at ERROR. (A NUL in a list filter used to reach
// PostgreSQL, answer 503 "retry" and log an ERROR.)
func TestRESTBadInput(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	tokens := filepath.Join(dir, "tokens")
	keys := cloudInitKeyring(t)
	if err := os.WriteFile(tokens, []byte("ops tok-ops admin\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dsn := orchtest.Database(t)
	proc, addrs := servicetest.Start(t, ".", []string{
		"--auth-token-file=" + tokens, "--providers-config=" + providersFile(t), "--cloud-init-key-file=" + keys,
		"--database-url=" + dsn, "--nats-url=" + natstest.New(t).URL(),
	})
	base := "http://" + addrs.HTTP
	// One proxy exists, so updates and deletes reach their checks.
	servicetest.CheckBadInput(t, base, "tok-ops", nil)
	req, _ := http.NewRequest("POST", base+"/v1/proxies", strings.NewReader(`{"name":"p1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local","cloudInit":"#cloud-config\n"}}`))
	req.Header.Set("Authorization", "Bearer tok-ops")
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("create p1: %v %v", resp, err)
	}
	resp.Body.Close()
	// What a client writes: the proxies, their labels, spec, generation,
	// skip_cleanup and deletion. (Revisions move on without any client:
	// the reconciler claims the proxy.)
	unchanged := servicetest.Unchanged(t, dsn, "the proxies", `SELECT count(*) || ' ' || coalesce(string_agg(concat_ws(':', name, generation,
		labels::text, encode(spec, 'hex'), cloud_init_key, skip_cleanup, delete_time IS NOT NULL), ',' ORDER BY name), '')
		FROM orchestrator.proxies`)

	spec := func(extra string) string {
		return `{"name":"p2","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"` + extra + `}}`
	}
	update := func(extra string) string {
		return `{"generation":"1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"` + extra + `}}`
	}
	huge := strings.Repeat("x", 2<<20)
	cases := []servicetest.BadInput{
		// CreateProxy
		{Name: "create: not JSON", Method: "POST", Path: "/v1/proxies", Body: `{"name":`, Status: 400, Field: "body"},
		{Name: "create: JSON array", Method: "POST", Path: "/v1/proxies", Body: `[1,2]`, Status: 400, Field: "body"},
		{Name: "create: unknown field", Method: "POST", Path: "/v1/proxies", Body: `{"name":"p2","colour":"red"}`, Status: 400, Field: "colour"},
		{Name: "create: name a number", Method: "POST", Path: "/v1/proxies", Body: `{"name":42}`, Status: 400, Field: "name"},
		{Name: "create: mode a number out of the enum", Method: "POST", Path: "/v1/proxies", Body: `{"name":"p2","spec":{"mode":7,"provider":"local"}}`, Status: 400, Field: "spec.mode"},
		{Name: "create: unknown mode name", Method: "POST", Path: "/v1/proxies", Body: `{"name":"p2","spec":{"mode":"PROXY_MODE_NONE"}}`, Status: 400},
		{Name: "create: NUL in the zone", Method: "POST", Path: "/v1/proxies", Body: spec(`,"placement":{"zone":"z\u0000"}`), Status: 400, Field: "spec.placement.zone"},
		{Name: "create: newline in the zone", Method: "POST", Path: "/v1/proxies", Body: spec(`,"placement":{"zone":"z\n1"}`), Status: 400, Field: "spec.placement.zone"},
		{Name: "create: bidi override in the image", Method: "POST", Path: "/v1/proxies", Body: spec(`,"placement":{"image":"a\u202eb"}`), Status: 400, Field: "spec.placement.image"},
		{Name: "create: ESC in cloud-init", Method: "POST", Path: "/v1/proxies", Body: spec(`,"cloudInit":"\u001b[31m"`), Status: 400, Field: "spec.cloud_init"},
		{Name: "create: NUL in a label", Method: "POST", Path: "/v1/proxies", Body: `{"name":"p2","labels":{"a":"b\u0000"},"spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`, Status: 400, Field: `labels["a"]`},
		{Name: "create: port out of range", Method: "POST", Path: "/v1/proxies", Body: spec(`,"port":70000`), Status: 400, Field: "spec.port"},
		{Name: "create: port over uint32", Method: "POST", Path: "/v1/proxies", Body: spec(`,"port":5000000000`), Status: 400},
		{Name: "create: negative port", Method: "POST", Path: "/v1/proxies", Body: spec(`,"port":-1`), Status: 400},
		{Name: "create: probe interval 1ms", Method: "POST", Path: "/v1/proxies", Body: spec(`,"healthCheck":{"interval":"0.001s"}`), Status: 400, Field: "spec.health_check.interval"},
		{Name: "create: cloud-init over 64 KiB", Method: "POST", Path: "/v1/proxies", Body: spec(`,"cloudInit":"` + strings.Repeat("a", 64<<10+1) + `"`), Status: 400, Field: "spec.cloud_init"},
		// Bodies over --max-request-bytes (1 MiB by default) are refused
		// while they are read, before any decoding.
		{Name: "create: 2 MiB body", Method: "POST", Path: "/v1/proxies", Body: spec(`,"cloudInit":"` + huge + `"`), Status: 413},
		{Name: "create: 6 MiB body", Method: "POST", Path: "/v1/proxies", Body: spec(`,"cloudInit":"` + strings.Repeat(huge, 3) + `"`), Status: 413},
		// GetProxy
		{Name: "get: NUL in the name", Method: "GET", Path: "/v1/proxies/p%00", Status: 400, Field: "name"},
		{Name: "get: newline in the name", Method: "GET", Path: "/v1/proxies/p%0A", Status: 400, Field: "name"},
		{Name: "get: upper-case name", Method: "GET", Path: "/v1/proxies/P1", Status: 400, Field: "name"},
		// ListProxies
		{Name: "list: NUL in the provider filter", Method: "GET", Path: "/v1/proxies?provider=local%00", Status: 400, Field: "provider"},
		{Name: "list: newline in the provider filter", Method: "GET", Path: "/v1/proxies?provider=a%0Ab", Status: 400, Field: "provider"},
		{Name: "list: NUL in a label filter", Method: "GET", Path: "/v1/proxies?labels%5Bpool%5D=eu%00", Status: 400, Field: `labels["pool"]`},
		{Name: "list: unknown phase number", Method: "GET", Path: "/v1/proxies?phase=42", Status: 400, Field: "phase"},
		{Name: "list: unknown phase name", Method: "GET", Path: "/v1/proxies?phase=SLEEPING", Status: 400, Field: "phase"},
		{Name: "list: page size not a number", Method: "GET", Path: "/v1/proxies?pageSize=ten", Status: 400, Field: "page_size"},
		{Name: "list: page size over int32", Method: "GET", Path: "/v1/proxies?pageSize=99999999999", Status: 400, Field: "page_size"},
		{Name: "list: page size 5000", Method: "GET", Path: "/v1/proxies?pageSize=5000", Status: 400, Field: "page_size"},
		{Name: "list: negative page size", Method: "GET", Path: "/v1/proxies?pageSize=-1", Status: 400, Field: "page_size"},
		{Name: "list: forged page token", Method: "GET", Path: "/v1/proxies?pageToken=eyJ4Ijox", Status: 400, Field: "page_token"},
		// UpdateProxy
		{Name: "update: not JSON", Method: "PUT", Path: "/v1/proxies/p1", Body: `{`, Status: 400, Field: "body"},
		{Name: "update: generation not a number", Method: "PUT", Path: "/v1/proxies/p1", Body: `{"generation":"one"}`, Status: 400},
		{Name: "update: negative generation", Method: "PUT", Path: "/v1/proxies/p1", Body: `{"generation":"-5","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`, Status: 400, Field: "generation"},
		{Name: "update: NUL in the etag", Method: "PUT", Path: "/v1/proxies/p1", Body: `{"etag":"r1\u0000","spec":{"mode":"PROXY_MODE_MANAGED","provider":"local"}}`, Status: 400, Field: "etag"},
		{Name: "update: NUL in the zone", Method: "PUT", Path: "/v1/proxies/p1", Body: update(`,"placement":{"zone":"\u0000"}`), Status: 400, Field: "spec.placement.zone"},
		{Name: "update: NUL in the path name", Method: "PUT", Path: "/v1/proxies/p%00", Body: update(""), Status: 400, Field: "name"},
		{Name: "update: max leases out of range", Method: "PUT", Path: "/v1/proxies/p1", Body: update(`,"lease":{"maxLeases":2000000}`), Status: 400, Field: "spec.lease.max_leases"},
		{Name: "update: unconfigured provider", Method: "PUT", Path: "/v1/proxies/p1", Body: `{"generation":"1","spec":{"mode":"PROXY_MODE_MANAGED","provider":"nope"}}`, Status: 400, Field: "spec.provider"},
		// DeleteProxy
		{Name: "delete: NUL in the name", Method: "DELETE", Path: "/v1/proxies/p1%00", Status: 400, Field: "name"},
		{Name: "delete: skipCleanup not a bool", Method: "DELETE", Path: "/v1/proxies/p1?skipCleanup=maybe", Status: 400, Field: "skip_cleanup"},
		// WatchProxies
		{Name: "watch: NUL in the provider filter", Method: "GET", Path: "/v1/proxies:watch?provider=%00", Status: 400, Field: "provider"},
		{Name: "watch: negative revision", Method: "GET", Path: "/v1/proxies:watch?sinceRevision=-1", Status: 400, Field: "since_revision"},
		{Name: "watch: revision not a number", Method: "GET", Path: "/v1/proxies:watch?sinceRevision=x", Status: 400, Field: "since_revision"},
		// ListProxyChanges
		{Name: "changes: upper-case name", Method: "GET", Path: "/v1/proxies/P1/changes", Status: 400, Field: "name"},
		{Name: "changes: page size 5000", Method: "GET", Path: "/v1/proxies/p1/changes?pageSize=5000", Status: 400, Field: "page_size"},
		{Name: "changes: negative revision", Method: "GET", Path: "/v1/proxies/p1/changes?beforeRevision=-1", Status: 400, Field: "before_revision"},
		{Name: "changes: revision not a number", Method: "GET", Path: "/v1/proxies/p1/changes?beforeRevision=x", Status: 400, Field: "before_revision"},
		// ListProviders takes nothing; a body on a GET is ignored, a wrong
		// method is the router's 405 in the same shape.
		{Name: "providers: wrong method", Method: "DELETE", Path: "/v1/providers", Status: 405},
	}
	servicetest.CheckBadInput(t, base, "tok-ops", cases)
	unchanged()
	servicetest.NoErrorLogs(t, proc)
}

// cloudInitKeyring writes a keyring with one fresh key and returns its path.
func cloudInitKeyring(t *testing.T) string {
	t.Helper()
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	keys := filepath.Join(t.TempDir(), "keys.yaml")
	if err := os.WriteFile(keys, []byte("active: k\nkeys:\n  k: "+base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return keys
}
