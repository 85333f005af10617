package egress

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Bad settings fail New with an error naming the setting, never the token.
func TestNewRejectsBadSettings(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, addr string
		o          Options
		want       string
	}{
		{"no address", "", Options{Token: "secret-token"}, "address is empty"},
		{"missing CA file", "lease:8110", Options{Token: "secret-token", CAFile: filepath.Join(dir, "absent.pem")}, "Options.CAFile"},
		{"CA file without PEM", "lease:8110", Options{Token: "secret-token", CAFile: notPEM}, "no PEM certificate"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, err := New(tc.addr, tc.o)
			if err == nil {
				c.Close()
				t.Fatal("New accepted bad settings")
			}
			if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "secret-token") {
				t.Fatalf("error %q, want it to name %q and not carry the token", err, tc.want)
			}
		})
	}
}

// A RoundTripper without a Client, or a request without a host, fails the
// request with an error naming what is missing.
func TestRoundTripperRejectsBadSetup(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		rt   *RoundTripper
		url  string
		want string
	}{
		{"no client", &RoundTripper{}, "https://shop.example/", "RoundTripper.Client"},
		{"no host", &RoundTripper{Client: &Client{}}, "/relative", "no host"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			req, err := http.NewRequest(http.MethodGet, tc.url, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tc.rt.RoundTrip(req); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("RoundTrip = %v, want an error naming %q", err, tc.want)
			}
		})
	}
}
