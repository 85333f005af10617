package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

// The running binary follows the providers file: its provider's changed
// entry rebuilds the backend; an entry that does not build, or a file that
// does not validate, keeps the one in effect with an ERROR and a failure
// counted; its provider removed stops taking commands, and back takes
// them again.
func TestProvidersConfigReloads(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "providers.yaml")
	write := func(content string) { t.Helper(); proctest.ReplaceFile(t, path, content) }
	entry := func(stateDir string) string {
		return "  - name: local\n    type: local\n    local: {stateDir: " + stateDir + ", proxy: builtin}\n"
	}
	write("providers:\n" + entry(t.TempDir()))
	p := binary.Start(t, provisionertest.Provider{Name: "local", Type: "local",
		Block: "local: {stateDir: " + t.TempDir() + ", proxy: builtin}\n"},
		provisionertest.StartOptions{NATSURL: natstest.New(t).URL(), Args: []string{"--providers-config=" + path}})
	failures := func() string {
		return proctest.MetricLine(t, p.HTTP, `egress_config_reload_failures_total{file="providers"}`)
	}
	countMsg := func(msg string) int {
		n := 0
		for _, l := range p.Logs() {
			if l["msg"] == msg {
				n++
			}
		}
		return n
	}
	p.WaitLog(t, 20*time.Second, proctest.Msg("taking provisioner commands"))
	if got := failures(); got != `egress_config_reload_failures_total{file="providers"} 0` {
		t.Errorf("at start the failure metric is %q, want 0", got)
	}

	write("providers:\n" + entry(t.TempDir()))
	p.WaitLog(t, 10*time.Second, proctest.Msg("this provider's entry in the providers config changed; its backend was rebuilt"))

	write("providers:\n  - name: local\n    type: local\n    local: {stateDri: /x, proxy: builtin}\n")
	waittest.For(t, 10*time.Second, "an entry that does not build counted", func() bool {
		return failures() == `egress_config_reload_failures_total{file="providers"} 1`
	})
	p.WaitLog(t, 5*time.Second, func(l map[string]any) bool {
		s, _ := l["error"].(string)
		return l["level"] == "ERROR" && strings.Contains(s, "providers[0].local.stateDri")
	})

	const secret = "tok-PROV-s3cret"
	write("providers:\n" + entry(t.TempDir()) + "  - {name: Bad_Name, type: gcp, gcp: {token: " + secret + "}}\n")
	waittest.For(t, 10*time.Second, "an invalid file counted", func() bool {
		return failures() == `egress_config_reload_failures_total{file="providers"} 2`
	})
	p.WaitLog(t, 5*time.Second, func(l map[string]any) bool {
		s, _ := l["error"].(string)
		return l["level"] == "ERROR" && strings.Contains(s, "providers[1].name") && strings.Contains(s, path)
	})
	if strings.Contains(p.Output(), secret) {
		t.Errorf("the log quotes the providers file's content")
	}

	write("providers:\n  - {name: other, type: local}\n")
	p.WaitLog(t, 10*time.Second, proctest.Msg("WARNING: this provider was removed from the providers config; commands are no longer taken until it is back"))
	p.WaitLog(t, 10*time.Second, proctest.Msg("stopped taking provisioner commands"))

	write("providers:\n" + entry(t.TempDir()))
	p.WaitLog(t, 10*time.Second, proctest.Msg("this provider is back in the providers config; commands are taken again"))
	waittest.For(t, 10*time.Second, "commands taken again", func() bool {
		return countMsg("taking provisioner commands") == 2
	})
}
