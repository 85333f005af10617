package access

import (
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/options"
)

func checker(t *testing.T, perMinute int) *Checker {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(path, []byte("crawler-a tok-a crawler\nviewer tok-v viewer\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	authn, err := auth.New(auth.Config{TokenFile: path}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	return NewChecker(authn, perMinute)
}

func TestCheck(t *testing.T) {
	t.Parallel()
	c := checker(t, 100)
	cases := []struct {
		name, user, pass string
		present          bool
		reason           Reason
		badOption        bool
		client           string
	}{
		{name: "good", user: "session-x", pass: "tok-a", present: true, client: "crawler-a"},
		{name: "no header", present: false, reason: Missing},
		{name: "empty password", user: "session-x", present: true, reason: Missing},
		{name: "wrong token", pass: "nope", present: true, reason: Invalid},
		{name: "no crawler role", pass: "tok-v", present: true, reason: NoRole},
		{name: "bad option after a good token", user: "colour-red", pass: "tok-a", present: true, badOption: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			caller, err := c.Check("10.0.0.1:5555", tc.user, tc.pass, tc.present)
			var refused *Refused
			var bad *options.Error
			switch {
			case tc.client != "":
				if err != nil || caller.ClientID != tc.client || caller.Options.Session != "x" {
					t.Fatalf("Check = %+v, %v", caller, err)
				}
			case tc.badOption:
				if !errors.As(err, &bad) {
					t.Fatalf("Check = %v, want an options error", err)
				}
			default:
				if !errors.As(err, &refused) || refused.Reason != tc.reason {
					t.Fatalf("Check = %v, want %s", err, tc.reason)
				}
			}
		})
	}
}

func TestFailuresAreRateLimitedPerSource(t *testing.T) {
	t.Parallel()
	c := checker(t, 3)
	now := time.Unix(1000, 0)
	c.now = func() time.Time { return now }
	for i := range 3 {
		if _, err := c.Check("192.0.2.1:1", "", "bad", true); err == nil || err.(*Refused).Reason != Invalid {
			t.Fatalf("failure %d: %v", i, err)
		}
	}
	// The source has used its failures: even a good token is refused.
	if _, err := c.Check("192.0.2.1:2", "", "tok-a", true); err == nil || err.(*Refused).Reason != RateLimited {
		t.Fatalf("after 3 failures: %v, want rate_limited", err)
	}
	// Another source is not affected.
	if _, err := c.Check("192.0.2.2:1", "", "tok-a", true); err != nil {
		t.Fatalf("another source: %v", err)
	}
	// A minute later one failure's worth has come back... and more.
	now = now.Add(time.Minute)
	if _, err := c.Check("192.0.2.1:3", "", "tok-a", true); err != nil {
		t.Fatalf("a minute later: %v", err)
	}
}

func TestBasic(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		h, user, pass string
		ok            bool
	}{
		{"Basic c2Vzc2lvbi1hOnRvaw==", "session-a", "tok", true},
		{"basic eDp4Onk=", "x", "x:y", true},
		{"Bearer tok", "", "", false},
		{"Basic !!!", "", "", false},
		{"Basic bm9jb2xvbg==", "", "", false},
	} {
		u, p, ok := ParseBasic(tc.h)
		if ok != tc.ok || (ok && (u != tc.user || p != tc.pass)) {
			t.Errorf("ParseBasic(%q) = %q, %q, %v", tc.h, u, p, ok)
		}
	}
}

func TestLimits(t *testing.T) {
	t.Parallel()
	l := NewLimits(3, 2)
	a1, err := l.Open("a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Open("a"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Open("a"); !errors.Is(err, ErrTooManyClientTunnels) {
		t.Fatalf("third of a: %v", err)
	}
	if _, err := l.Open("b"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Open("c"); !errors.Is(err, ErrTooManyTunnels) {
		t.Fatalf("fourth in all: %v", err)
	}
	a1()
	a1() // ending twice counts once
	if l.Active() != 2 {
		t.Fatalf("active = %d", l.Active())
	}
	if _, err := l.Open("c"); err != nil {
		t.Fatal(err)
	}
}
