package lifecycle

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// declaredReasons reads every Reason constant of reasons.go.
func declaredReasons(t *testing.T) map[string]Reason {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "reasons.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]Reason{}
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
					t.Fatalf("%s is not a string literal", name.Name)
				}
				val, err := strconv.Unquote(lit.Value)
				if err != nil {
					t.Fatal(err)
				}
				out[name.Name] = Reason(val)
			}
		}
	}
	return out
}

// Every reason is declared once under a name that says it, and the
// orchestrator's doc lists each in its reasons table.
func TestReasonsAreDocumented(t *testing.T) {
	t.Parallel()
	reasons := declaredReasons(t)
	if len(reasons) < 17 {
		t.Fatalf("read %d reasons from reasons.go; the parser missed some", len(reasons))
	}
	doc, err := os.ReadFile("../../../../docs/orchestrator.md")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[Reason]string{}
	for name, r := range reasons {
		if name != "Reason"+string(r) {
			t.Errorf("constant %s holds %q; name it Reason%s", name, r, r)
		}
		if other, dup := seen[r]; dup {
			t.Errorf("%s and %s both hold %q", name, other, r)
		}
		seen[r] = name
		if !strings.Contains(string(doc), "| `"+string(r)+"` |") {
			t.Errorf("docs/orchestrator.md has no row | `%s` | in its reasons table", r)
		}
	}
}
