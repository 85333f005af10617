package chart

import (
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

var (
	metricRE   = regexp.MustCompile(`egress_[a-z_]+`)
	literalRE  = regexp.MustCompile(`"(egress_[a-z_]+)"`)
	composedRE = regexp.MustCompile(`Namespace:\s*"(\w+)",\s*Subsystem:\s*"(\w+)",\s*Name:\s*"(\w+)"`)

	exportedOnce sync.Once
	exported     map[string]bool
)

// exportedMetrics reads the metric names out of the services' and pkg's Go
// sources, so alerts and panels cannot name a metric nobody exports.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	exportedOnce.Do(func() {
		exported = map[string]bool{}
		root := filepath.Join(Dir(), "..", "..", "..")
		for _, dir := range []string{"services", "pkg"} {
			_ = filepath.WalkDir(filepath.Join(root, dir), func(path string, d fs.DirEntry, err error) error {
				if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
					return err
				}
				src, err := os.ReadFile(path)
				if err != nil {
					return err
				}
				for _, m := range literalRE.FindAllStringSubmatch(string(src), -1) {
					exported[m[1]] = true
				}
				for _, m := range composedRE.FindAllStringSubmatch(string(src), -1) {
					exported[m[1]+"_"+m[2]+"_"+m[3]] = true
				}
				return nil
			})
		}
	})
	if len(exported) < 10 {
		t.Fatalf("found only %d metric names in the sources", len(exported))
	}
	return exported
}

// checkMetricNames fails for every egress_ metric in expr that no service
// exports (histogram series carry _bucket, _sum, _count).
func checkMetricNames(t *testing.T, where, expr string) {
	t.Helper()
	names := metricRE.FindAllString(expr, -1)
	if len(names) == 0 {
		t.Errorf("%s: %q uses no egress_ metric", where, expr)
	}
	for _, n := range names {
		base := n
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			base = strings.TrimSuffix(base, suffix)
		}
		if !exportedMetrics(t)[n] && !exportedMetrics(t)[base] {
			t.Errorf("%s: metric %s is not exported by any service", where, n)
		}
	}
}

func checkServiceMonitor(t *testing.T, sm map[string]any, svcs map[string]*corev1.Service) {
	t.Helper()
	sel, _, _ := unstructured.NestedStringMap(sm, "spec", "selector", "matchLabels")
	eps, _, _ := unstructured.NestedSlice(sm, "spec", "endpoints")
	if len(eps) != 1 || eps[0].(map[string]any)["port"] != "http" || eps[0].(map[string]any)["path"] != "/metrics" {
		t.Errorf("ServiceMonitor endpoints %v, want port http /metrics", eps)
	}
	n := 0
	for name, s := range svcs {
		if subset(sel, s.Labels) {
			n++
		} else {
			t.Errorf("ServiceMonitor selector %v misses Service %s", sel, name)
		}
	}
	if n == 0 {
		t.Error("ServiceMonitor selects no Service")
	}
}

func checkAlerts(t *testing.T, rule map[string]any) {
	t.Helper()
	groups, _, _ := unstructured.NestedSlice(rule, "spec", "groups")
	var alerts []string
	for _, g := range groups {
		rules, _, _ := unstructured.NestedSlice(g.(map[string]any), "rules")
		for _, r := range rules {
			r := r.(map[string]any)
			name, _ := r["alert"].(string)
			expr, _ := r["expr"].(string)
			alerts = append(alerts, name)
			checkMetricNames(t, "alert "+name, expr)
			if !strings.Contains(expr, `namespace="egress"`) {
				t.Errorf("alert %s: %q is not limited to the release's namespace", name, expr)
			}
			if sev, _, _ := unstructured.NestedString(r, "labels", "severity"); sev == "" {
				t.Errorf("alert %s has no severity", name)
			}
		}
	}
	want := []string{"EgressProviderNotReady", "EgressProxiesFailed", "EgressNoLeasableProxy", "EgressCommandBacklog"}
	if !slices.Equal(alerts, want) {
		t.Errorf("alerts %v, want %v", alerts, want)
	}
}

func checkDashboard(t *testing.T, cm *corev1.ConfigMap) {
	t.Helper()
	if cm == nil {
		t.Fatal("no dashboard ConfigMap")
	}
	if cm.Labels["grafana_dashboard"] != "1" {
		t.Errorf("dashboard labels %v, want grafana_dashboard=1 for the sidecar", cm.Labels)
	}
	var dash struct {
		Title  string
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal([]byte(cm.Data["egress-proxies.json"]), &dash); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	if dash.Title == "" || len(dash.Panels) < 8 {
		t.Errorf("dashboard %q has %d panels", dash.Title, len(dash.Panels))
	}
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			checkMetricNames(t, "panel "+p.Title, tg.Expr)
		}
	}
}
