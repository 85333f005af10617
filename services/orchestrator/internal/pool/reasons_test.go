package pool

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

// Every word the controller writes as a reason or condition is declared in
// reasons.go and listed in docs/pools.md; the quota reason is the
// lifecycle's own.
func TestReasonsAreDocumented(t *testing.T) {
	t.Parallel()
	f, err := parser.ParseFile(token.NewFileSet(), "reasons.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../../../../docs/pools.md")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, s := range g.Specs {
			v := s.(*ast.ValueSpec)
			for i, name := range v.Names {
				lit, ok := v.Values[i].(*ast.BasicLit)
				if !ok {
					continue // RemoveQuotaExceeded, checked below
				}
				val, err := strconv.Unquote(lit.Value)
				if err != nil {
					t.Fatal(err)
				}
				n++
				if !strings.Contains(string(doc), "`"+val+"`") {
					t.Errorf("docs/pools.md does not list %s (%q)", name.Name, val)
				}
			}
		}
	}
	if n < 24 {
		t.Fatalf("read %d reasons from reasons.go; the parser missed some", n)
	}
	if RemoveQuotaExceeded != string(lifecycle.ReasonQuotaExceeded) || !strings.Contains(string(doc), "`"+RemoveQuotaExceeded+"`") {
		t.Errorf("RemoveQuotaExceeded = %q, want the lifecycle's %q, listed in docs/pools.md", RemoveQuotaExceeded, lifecycle.ReasonQuotaExceeded)
	}
}
