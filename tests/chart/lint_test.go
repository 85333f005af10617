package chart

import (
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/lint/support"
)

// TestLint runs helm's linter, as `make lint` does, with each values file:
// no error and no warning.
func TestLint(t *testing.T) {
	t.Parallel()
	files, err := ValuesFiles()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		vals, err := Values([]string{f})
		if err != nil {
			t.Fatal(err)
		}
		lint := action.NewLint()
		lint.Strict = true
		lint.Namespace = relNS
		res := lint.Run([]string{Dir()}, vals)
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: %s", f, m)
			}
		}
		for _, err := range res.Errors {
			t.Errorf("%s: %v", f, err)
		}
	}
}
