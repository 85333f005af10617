package chart

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/release"
	"helm.sh/helm/v3/pkg/releaseutil"
	"helm.sh/helm/v3/pkg/storage"
	"helm.sh/helm/v3/pkg/storage/driver"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	sigsyaml "sigs.k8s.io/yaml"
)

// Dir is the chart's directory.
func Dir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "deploy", "helm", "egress-proxies")
}

// TestdataDir holds the values files the tests install with.
func TestdataDir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "testdata")
}

// Load reads the chart.
func Load() (*chart.Chart, error) {
	return loader.Load(Dir())
}

// Values merges the values files (relative names are in TestdataDir) and
// then the overrides, as `helm -f a -f b --set-json` would.
func Values(files []string, overrides ...map[string]any) (map[string]any, error) {
	out := map[string]any{}
	for _, f := range files {
		if !filepath.IsAbs(f) {
			f = filepath.Join(TestdataDir(), f)
		}
		v, err := chartutil.ReadValuesFile(f)
		if err != nil {
			return nil, err
		}
		out = chartutil.CoalesceTables(v.AsMap(), out)
	}
	for _, o := range overrides {
		out = chartutil.MergeTables(deepCopy(o), out)
	}
	return out, nil
}

func deepCopy(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		if mm, ok := v.(map[string]any); ok {
			out[k] = deepCopy(mm)
		} else {
			out[k] = v
		}
	}
	return out
}

// Rendered is one release rendered client-side, as `helm template` does.
type Rendered struct {
	Release *release.Release
	// Objects are the manifests installed with the release, in install
	// order.
	Objects []Object
	// Hooks are the hook manifests.
	Hooks []Hook
}

// Object is one decoded manifest: Typed is a k8s.io/api type when the
// client-go scheme knows the kind, else nil and only Raw is set.
type Object struct {
	Kind, Name string
	Typed      any
	Raw        *unstructured.Unstructured
}

// Hook is a decoded hook manifest with its events and weight.
type Hook struct {
	Object
	Events []release.HookEvent
	Weight int
}

// Render renders the chart with vals as release name in namespace ns and
// decodes every manifest strictly: an unknown or mistyped field fails.
func Render(name, ns string, vals map[string]any) (*Rendered, error) {
	chrt, err := Load()
	if err != nil {
		return nil, err
	}
	cfg := &action.Configuration{Releases: storage.Init(driver.NewMemory()), Log: func(string, ...any) {}}
	inst := action.NewInstall(cfg)
	inst.DryRun = true
	inst.ClientOnly = true
	inst.ReleaseName = name
	inst.Namespace = ns
	inst.KubeVersion = &chartutil.KubeVersion{Version: "v1.37.2", Major: "1", Minor: "37"}
	rel, err := inst.Run(chrt, vals)
	if err != nil {
		return nil, err
	}
	out := &Rendered{Release: rel}
	manifests := releaseutil.SplitManifests(rel.Manifest)
	_, sorted, err := releaseutil.SortManifests(manifests, nil, releaseutil.InstallOrder)
	if err != nil {
		return nil, err
	}
	for _, m := range sorted {
		objs, err := Decode([]byte(m.Content))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.Name, err)
		}
		out.Objects = append(out.Objects, objs...)
	}
	for _, h := range rel.Hooks {
		objs, err := Decode([]byte(h.Manifest))
		if err != nil {
			return nil, fmt.Errorf("hook %s: %w", h.Path, err)
		}
		for _, o := range objs {
			out.Hooks = append(out.Hooks, Hook{Object: o, Events: h.Events, Weight: h.Weight})
		}
	}
	return out, nil
}

var strict = json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
	json.SerializerOptions{Yaml: true, Strict: true})

// Decode splits a YAML stream and decodes each document strictly into its
// typed object (kinds the client-go scheme does not know stay unstructured
// but must still be well-formed YAML with apiVersion, kind and name).
func Decode(data []byte) ([]Object, error) {
	var out []Object
	r := k8syaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		raw := &unstructured.Unstructured{}
		if err := sigsyaml.UnmarshalStrict(doc, &raw.Object); err != nil {
			return nil, err
		}
		if len(raw.Object) == 0 {
			continue
		}
		if raw.GetKind() == "" || raw.GetAPIVersion() == "" || raw.GetName() == "" {
			return nil, fmt.Errorf("manifest without apiVersion, kind or name:\n%s", doc)
		}
		o := Object{Kind: raw.GetKind(), Name: raw.GetName(), Raw: raw}
		if scheme.Scheme.Recognizes(raw.GroupVersionKind()) {
			typed, _, err := strict.Decode(doc, nil, nil)
			if err != nil {
				return nil, fmt.Errorf("%s %s: %w", o.Kind, o.Name, err)
			}
			o.Typed = typed
		}
		out = append(out, o)
	}
}

// ValuesFiles lists the values files in TestdataDir, sorted.
func ValuesFiles() ([]string, error) {
	entries, err := os.ReadDir(TestdataDir())
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".yaml") {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out, nil
}
