package main

import (
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The providers file is reloaded by the running binary: a provider added
// is listed without a restart, an invalid version keeps the one in effect
// (an ERROR naming the field, never the content, and a failure counted),
// and a provider removed is no longer listed nor served.
func TestProvidersConfigReloads(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	gs := grpc.NewServer()
	provisionerv1.RegisterProvisionerServiceServer(gs, checkingProvisioner{})
	provAddr := grpctest.Serve(t, gs)
	path := filepath.Join(e.dir, "providers.yaml")
	write := func(content string) { t.Helper(); proctest.ReplaceFile(t, path, content) }
	write("providers:\n  - {name: local-1, type: local}\n")
	p, addrs := servicetest.Start(t, ".", e.args("replica-a",
		"--providers-config="+path, "--provisioner=local-1="+provAddr, "--provider-check-interval=10s"))
	base := "http://" + addrs.HTTP
	listed := func() string {
		var list struct {
			Providers []struct {
				Provider string `json:"provider"`
			} `json:"providers"`
		}
		if code := getJSON(t, base+"/v1/health/providers", &list); code != http.StatusOK {
			return fmt.Sprintf("HTTP %d", code)
		}
		var names []string
		for _, p := range list.Providers {
			names = append(names, p.Provider)
		}
		return strings.Join(names, ",")
	}
	failures := func() string {
		return proctest.MetricLine(t, addrs.HTTP, `egress_config_reload_failures_total{file="providers"}`)
	}
	if got := listed(); got != "local-1" {
		t.Fatalf("listed at start = %q, want local-1", got)
	}
	waittest.For(t, 20*time.Second, "local-1 checked", func() bool {
		return getJSON(t, base+"/v1/health/providers/local-1", nil) == http.StatusOK
	})

	write("providers:\n  - {name: local-1, type: local}\n  - {name: gcp-eu, type: gcp}\n")
	waittest.ForErr(t, 10*time.Second, "gcp-eu listed", func() error {
		if got := listed(); got != "local-1,gcp-eu" {
			return fmt.Errorf("listed %q", got)
		}
		return nil
	})

	const secret = "tok-HEALTH-s3cret"
	write("providers:\n  - {name: local-1, type: local, local: {token: " + secret + "}}\n  - {name: gcp-eu, type: gcpx}\n")
	waittest.For(t, 10*time.Second, "the rejected version counted", func() bool {
		return failures() == `egress_config_reload_failures_total{file="providers"} 1`
	})
	p.WaitLog(t, 5*time.Second, func(l map[string]any) bool {
		s, _ := l["error"].(string)
		return l["level"] == "ERROR" && strings.Contains(s, "providers[1].type") && strings.Contains(s, path)
	})
	if strings.Contains(p.Output(), secret) {
		t.Errorf("the log quotes the providers file's content")
	}
	if got := listed(); got != "local-1,gcp-eu" {
		t.Errorf("listed while the file is invalid = %q, want the old config", got)
	}

	write("providers:\n  - {name: gcp-eu, type: gcp}\n")
	waittest.ForErr(t, 10*time.Second, "local-1 gone", func() error {
		if got := listed(); got != "gcp-eu" {
			return fmt.Errorf("listed %q", got)
		}
		return nil
	})
	if code := getJSON(t, base+"/v1/health/providers/local-1", nil); code != http.StatusNotFound {
		t.Errorf("GET the removed provider = %d, want 404", code)
	}
}
