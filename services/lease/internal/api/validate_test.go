package api

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestTargetHost(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{"", "", true},
		{"shop.example.com", "shop.example.com", true},
		{"Shop.Example.COM.", "shop.example.com", true},
		{"localhost", "localhost", true},
		{"10.0.0.1", "10.0.0.1", true},
		{"[2001:db8::1]", "2001:db8::1", true},
		{"2001:DB8::1", "2001:db8::1", true},
		{"xn--bcher-kva.example", "xn--bcher-kva.example", true},
		{"shop.example.com:443", "", false},
		{"https://shop.example.com", "", false},
		{"shop.example.com/path", "", false},
		{"user@shop.example.com", "", false},
		{"-shop.example.com", "", false},
		{"shop..example.com", "", false},
		{"shop example.com", "", false},
		{strings.Repeat("a", 64) + ".com", "", false},
		{strings.Repeat("abcdefghi.", 26) + "com", "", false},
		{".", "", false},
	} {
		got, err := targetHost(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("targetHost(%q) = %q, %v; want %q, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
		if err != nil {
			if status.Code(err) != codes.InvalidArgument || !strings.HasPrefix(status.Convert(err).Message(), "invalid request: target_host: ") {
				t.Errorf("targetHost(%q) error %v does not name the field", tc.in, err)
			}
		}
	}
}

func TestLeaseID(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{"123e4567-e89b-42d3-a456-426614174000", "123e4567-e89b-42d3-a456-426614174000", true},
		{"123E4567-E89B-42D3-A456-426614174000", "123e4567-e89b-42d3-a456-426614174000", true},
		{"", "", false},
		{"123e4567e89b42d3a456426614174000", "", false},
		{"{123e4567-e89b-42d3-a456-426614174000}", "", false},
		{"urn:uuid:123e4567-e89b-42d3-a456-426614174000", "", false},
		{"lease-1", "", false},
	} {
		got, err := leaseID(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("leaseID(%q) = %q, %v; want %q, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// FuzzTargetHost: whatever a client sends, the result is an error naming
// the field, or a normal form that is stable under a second pass.
func FuzzTargetHost(f *testing.F) {
	for _, s := range []string{"shop.example.com", "A.B.", "10.0.0.1", "[::1]", "a:1", "é.example", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		got, err := targetHost(in)
		if err != nil {
			if !strings.HasPrefix(status.Convert(err).Message(), "invalid request: target_host: ") {
				t.Fatalf("error %v does not name the field", err)
			}
			return
		}
		again, err := targetHost(got)
		if err != nil || again != got {
			t.Fatalf("targetHost(%q) = %q, but again gives %q, %v", in, got, again, err)
		}
		if len(got) > 253 || strings.ContainsAny(got, " /@?#") {
			t.Fatalf("targetHost(%q) = %q", in, got)
		}
	})
}
