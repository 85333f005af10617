package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// The providers file is reloaded by the running binary: a provider added
// is accepted without a restart, an invalid version keeps the one in
// effect (one ERROR naming the field, never the content, and a failure
// counted), and a provider removed puts its proxies in
// ProviderNotConfigured, as at start.
func TestProvidersConfigReloads(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "providers.yaml")
	// Through a rename, as a mounted ConfigMap changes.
	write := func(content string) { t.Helper(); proctest.ReplaceFile(t, path, content) }
	write("providers:\n  - {name: local, type: local}\n")
	p, addrs := servicetest.Start(t, ".", []string{
		"--auth-disabled",
		"--providers-config=" + path,
		"--create-deadline=1s",
		"--cloud-init-key-file=" + cloudInitKeyring(t), // managed proxies' credentials are sealed with it
		"--database-url=" + orchtest.Database(t),
		"--nats-url=" + natstest.New(t).URL(),
	})
	base := "http://" + addrs.HTTP
	call := func(method, path, body string) (int, map[string]any) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		var out map[string]any
		_ = json.Unmarshal(raw, &out)
		return resp.StatusCode, out
	}
	metric := func() string {
		t.Helper()
		return proctest.MetricLine(t, addrs.HTTP, `egress_config_reload_failures_total{file="providers"}`)
	}
	create := func(name, provider string) (int, map[string]any) {
		return call("POST", "/v1/proxies", fmt.Sprintf(`{"name":%q,"spec":{"mode":"PROXY_MODE_MANAGED","provider":%q}}`, name, provider))
	}
	if code, body := create("p0", "extra"); code != http.StatusBadRequest || !strings.Contains(toString(body["message"]), "spec.provider") {
		t.Fatalf("create on an unknown provider = %d %v, want 400 naming spec.provider", code, body)
	}
	if got := metric(); got != `egress_config_reload_failures_total{file="providers"} 0` {
		t.Errorf("at start the failure metric is %q, want 0", got)
	}

	// Added: taken without a restart.
	write("providers:\n  - {name: local, type: local}\n  - {name: extra, type: local}\n")
	waittest.ForErr(t, 10*time.Second, "the added provider accepted", func() error {
		if code, body := create("p1", "extra"); code != http.StatusOK {
			return fmt.Errorf("create on extra = %d %v", code, body)
		}
		return nil
	})
	if _, body := call("GET", "/v1/providers", ""); !strings.Contains(toString(body), "extra") {
		t.Errorf("ListProviders after the add = %v, want extra in it", body)
	}

	// Invalid: the version before stays, with an ERROR and a failure.
	const secret = "tok-RELOAD-s3cret"
	write("providers:\n  - {name: local, type: local, local: {token: " + secret + "}}\n  - {name: Extra_2, type: local}\n")
	waittest.For(t, 10*time.Second, "the rejected version counted", func() bool {
		return metric() == `egress_config_reload_failures_total{file="providers"} 1`
	})
	p.WaitLog(t, 5*time.Second, func(l map[string]any) bool {
		return l["level"] == "ERROR" && strings.Contains(toString(l["error"]), "providers[1].name") &&
			strings.Contains(toString(l["error"]), path)
	})
	if strings.Contains(p.Output(), secret) {
		t.Errorf("the log quotes the providers file's content")
	}
	if code, body := create("p2", "extra"); code != http.StatusOK {
		t.Errorf("create on extra while the file is invalid = %d %v, want the old config in effect", code, body)
	}

	// Removed: the proxies on it become ProviderNotConfigured.
	write("providers:\n  - {name: local, type: local}\n")
	waittest.ForErr(t, 30*time.Second, "p1 ProviderNotConfigured", func() error {
		_, body := call("GET", "/v1/proxies/p1", "")
		proxy, _ := body["proxy"].(map[string]any)
		status, _ := proxy["status"].(map[string]any)
		if status["reason"] != "ProviderNotConfigured" {
			return fmt.Errorf("p1 status = %v", status)
		}
		return nil
	})
	if code, body := create("p3", "extra"); code != http.StatusBadRequest {
		t.Errorf("create on the removed provider = %d %v, want 400", code, body)
	}
	if got := metric(); got != `egress_config_reload_failures_total{file="providers"} 1` {
		t.Errorf("after a valid version the failure metric is %q, want still 1", got)
	}
}
