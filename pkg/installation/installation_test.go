package installation

import (
	"strings"
	"testing"
)

func TestValid(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"staging", true},
		{"prod-eu-1", true},
		{"a", true},
		{"0", true},
		{strings.Repeat("a", MaxLen), true},
		{strings.Repeat("a", MaxLen+1), false},
		{"", false},
		{"Prod", false},
		{"-prod", false},
		{"prod-", false},
		{"prod_eu", false},
		{"prod.eu", false},
		{"prod eu", false},
	} {
		if err := Valid(tc.id); (err == nil) != tc.ok {
			t.Errorf("Valid(%q) = %v, want ok %v", tc.id, err, tc.ok)
		}
	}
}

func TestDerive(t *testing.T) {
	t.Parallel()
	a := Derive(7419391283746123, "egress")
	if err := Valid(a); err != nil {
		t.Fatalf("Derive answered an invalid identity: %v", err)
	}
	if a != Derive(7419391283746123, "egress") {
		t.Error("Derive is not stable")
	}
	for _, other := range []string{Derive(7419391283746123, "egress_staging"), Derive(7419391283746124, "egress")} {
		if other == a {
			t.Errorf("two installations share the identity %s", a)
		}
	}
}
