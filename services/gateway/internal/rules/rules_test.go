package rules

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

const sample = `
bodyLimitKiB: 1
rules:
  - name: banned-status
    outcome: banned
    status: [429, 403]
    hosts: [Shop.Example.com.]
  - name: guard
    outcome: blocked
    header: {name: server, contains: DDoS-Guard}
    retry: false
  - name: captcha
    outcome: captcha
    status: [200]
    body: "are you a robot"
`

func TestClassify(t *testing.T) {
	t.Parallel()
	s, err := Parse([]byte(sample))
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		host   string
		status int
		header http.Header
		body   string
		want   Match
		ok     bool
	}{
		{"status on its host", "shop.example.com", 403, nil, "", Match{"banned-status", Banned, true}, true},
		{"status on another host", "other.example", 403, nil, "", Match{}, false},
		{"header contains", "other.example", 200, http.Header{"Server": {"ddos-guard/2"}}, "", Match{"guard", Blocked, false}, true},
		{"header absent", "other.example", 503, http.Header{"Server": {"nginx"}}, "", Match{}, false},
		{"body substring", "x", 200, nil, "<h1>Are you a robot? are you a robot</h1>", Match{"captcha", Captcha, true}, true},
		{"body but other status", "x", 404, nil, "are you a robot", Match{}, false},
		{"plain success", "x", 200, nil, "hello", Match{}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got, ok := s.Classify(c.host, c.status, c.header, []byte(c.body))
			if ok != c.ok || got != c.want {
				t.Fatalf("Classify = %+v, %v; want %+v, %v", got, ok, c.want, c.ok)
			}
		})
	}
	if !s.NeedsBody("x", 200) || s.NeedsBody("x", 404) {
		t.Fatal("NeedsBody: the captcha rule reads bodies of 200s only")
	}
	if s.BodyLimit() != 1024 {
		t.Fatalf("BodyLimit = %d", s.BodyLimit())
	}
}

func TestParseRefuses(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, doc, want string }{
		{"unknown top key", "rulez: []", "rulez: unknown field"},
		{"unknown rule key", "rules: [{name: a, outcome: banned, status: [403], code: 1}]", "rules[0].code: unknown field"},
		{"unknown header key", "rules: [{name: a, outcome: banned, header: {name: x, value: y}}]", "rules[0].header.value: unknown field"},
		{"no name", "rules: [{outcome: banned, status: [403]}]", "rules[0].name: required"},
		{"duplicate name", "rules: [{name: a, outcome: banned, status: [403]}, {name: a, outcome: banned, status: [429]}]", `rules[1].name: "a" is used twice`},
		{"bad outcome", "rules: [{name: a, outcome: slow, status: [403]}]", `rules[0].outcome: "slow"`},
		{"bad status", "rules: [{name: a, outcome: banned, status: [42]}]", "rules[0].status[0]: 42"},
		{"no condition", "rules: [{name: a, outcome: banned}]", "rules[0]: set at least one"},
		{"empty header name", "rules: [{name: a, outcome: banned, header: {contains: x}}]", "rules[0].header.name: required"},
		{"limit", "bodyLimitKiB: 4096", "bodyLimitKiB"},
		{"wrong type", "rules: {name: a}", "cannot unmarshal"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse([]byte(c.doc))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Parse: %v; want an error containing %q", err, c.want)
			}
		})
	}
}

func TestEmpty(t *testing.T) {
	t.Parallel()
	s, err := Parse(nil)
	if err != nil || !s.Empty() || s.BodyLimit() != DefaultBodyLimitKiB<<10 {
		t.Fatalf("Parse(nil) = %+v, %v", s, err)
	}
	var none *Set
	if _, ok := none.Classify("x", 403, nil, nil); ok || !none.Empty() {
		t.Fatal("a nil set matched")
	}
}

func TestReadPrefix(t *testing.T) {
	t.Parallel()
	prefix, body, err := ReadPrefix(io.NopCloser(strings.NewReader("abcdefgh")), 3)
	if err != nil || string(prefix) != "abc" {
		t.Fatalf("prefix %q, %v", prefix, err)
	}
	all, _ := io.ReadAll(body)
	if string(all) != "abcdefgh" {
		t.Fatalf("body %q", all)
	}
	prefix, body, _ = ReadPrefix(io.NopCloser(strings.NewReader("ab")), 3)
	all, _ = io.ReadAll(body)
	if string(prefix) != "ab" || string(all) != "ab" {
		t.Fatalf("short body: %q, %q", prefix, all)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(sample))
	f.Add([]byte("rules: [{name: a, outcome: banned, status: [403]}]"))
	f.Fuzz(func(t *testing.T, doc []byte) {
		s, err := Parse(doc)
		if err != nil {
			return
		}
		s.Classify("x", 403, http.Header{"A": {"b"}}, doc)
	})
}
