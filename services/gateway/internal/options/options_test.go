package options

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

func TestParse(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in   string
		want Options
	}{
		{"", Options{}},
		{"session-abc123", Options{Session: "abc123"}},
		{"session-a-b.c_d", Options{Session: "a-b.c_d"}},
		{"pool-web-eu", Options{Pool: "web-eu"}},
		{"session-cart42,pool-web,provider-local,region-eu-west,zone-eu-west-1b,label-market=eu,label-tier=gold,lifetime-10m", Options{
			Session: "cart42", Pool: "web", Provider: "local", Region: "eu-west", Zone: "eu-west-1b",
			Labels: map[string]string{"market": "eu", "tier": "gold"}, Lifetime: 10 * time.Minute,
		}},
		{"label-team=", Options{Labels: map[string]string{"team": ""}}},
		{"label-example.com/team=a", Options{Labels: map[string]string{"example.com/team": "a"}}},
		{"lifetime-10s", Options{Lifetime: 10 * time.Second}},
		{"lifetime-1h", Options{Lifetime: time.Hour}},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			t.Parallel()
			got, err := Parse(c.in)
			if err != nil {
				t.Fatalf("Parse(%q): %v", c.in, err)
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("Parse(%q) = %+v, want %+v", c.in, got, c.want)
			}
		})
	}
}

func TestParseRefuses(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in, option, reason string
	}{
		{"country-us", "country-us", "unknown option country"},
		{"session", "session", "want key-value"},
		{"session-", "session-", "empty value"},
		{"session-a,", "", "empty option"},
		{",session-a", "", "empty option"},
		{"session-a,,pool-b", "", "empty option"},
		{"session-a,session-b", "session-b", "given twice"},
		{"pool-a,pool-b", "pool-b", "given twice"},
		{"session-a b", "session-a b", "session id"},
		{"session-" + strings.Repeat("x", 65), "session-" + strings.Repeat("x", 56) + "…", "session id"},
		{"pool-Web", "pool-Web", "pool name"},
		{"pool-web-", "pool-web-", "pool name"},
		{"region-eu west", "region-eu west", "region"},
		{"label-market", "label-market", "label-key=value"},
		{"label-=x", "label-=x", "label key"},
		{"label-a=b c", "label-a=b c", "label value"},
		{"label-a=1,label-a=2", "label-a=2", "given twice"},
		{"lifetime-10", "lifetime-10", "duration"},
		{"lifetime-1s", "lifetime-1s", "between"},
		{"lifetime-2h", "lifetime-2h", "between"},
		{"lifetime--1m", "lifetime--1m", "between"},
		{strings.Repeat("a", 256), strings.Repeat("a", 64) + "…", "longer than 255"},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			t.Parallel()
			_, err := Parse(c.in)
			var oe *Error
			if !errors.As(err, &oe) {
				t.Fatalf("Parse(%q) = %v, want an *Error", c.in, err)
			}
			if oe.Option != c.option {
				t.Errorf("Parse(%q) names option %q, want %q", c.in, oe.Option, c.option)
			}
			if !strings.Contains(oe.Reason, c.reason) {
				t.Errorf("Parse(%q) reason %q, want it to contain %q", c.in, oe.Reason, c.reason)
			}
		})
	}
}

func TestSessionKey(t *testing.T) {
	t.Parallel()
	if got := SessionKey("c", ""); got != "" {
		t.Fatalf("no session: %q", got)
	}
	if got := SessionKey("crawler-1", "abc"); got != "gw/crawler-1/abc" {
		t.Fatalf("got %q", got)
	}
	long := strings.Repeat("c", 100)
	k1, k2 := SessionKey(long, strings.Repeat("s", 64)), SessionKey(long+"x", strings.Repeat("s", 64))
	if len(k1) > maxSessionKey || k1 == k2 {
		t.Fatalf("long client ids: %q (%d) and %q", k1, len(k1), k2)
	}
	if SessionKey("a", "b") == SessionKey("b", "b") {
		t.Fatal("two clients share a session key")
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{"", "session-a", "session-a,pool-b,label-x=y,lifetime-1m", "label-a=b=c", "lifetime-1h0m", ",", "-", "zone-\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		o, err := Parse(s)
		if err != nil {
			var oe *Error
			if !errors.As(err, &oe) {
				t.Fatalf("Parse(%q): not an *Error: %v", s, err)
			}
			if len(oe.Option) > 64+len("…") {
				t.Fatalf("Parse(%q): option echoed unclipped: %q", s, oe.Option)
			}
			return
		}
		if len(s) > MaxUsername {
			t.Fatalf("Parse(%q) accepted %d bytes", s, len(s))
		}
		for _, v := range []string{o.Session, o.Pool, o.Provider, o.Region, o.Zone} {
			if strings.ContainsAny(v, ",: \x00") || !utf8.ValidString(v) {
				t.Fatalf("Parse(%q) accepted value %q", s, v)
			}
		}
		if o.Lifetime != 0 && (o.Lifetime < MinLifetime || o.Lifetime > MaxLifetime) {
			t.Fatalf("Parse(%q) accepted lifetime %s", s, o.Lifetime)
		}
		if len(SessionKey("client", o.Session)) > maxSessionKey {
			t.Fatalf("session key too long for %q", s)
		}
	})
}
