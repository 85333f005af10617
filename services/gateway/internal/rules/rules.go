// Package rules classifies a plain-HTTP response seen through a proxy as a
// ban, a block or a captcha, from a YAML file of rules:
//
//	bodyLimitKiB: 64            # how much of a body the rules may read (default 64)
//	rules:
//	  - name: forbidden
//	    outcome: blocked        # banned, blocked or captcha
//	    status: [403]           # any of these codes…
//	    header: {name: Server, contains: "ddos-guard"}  # …and this header…
//	    body: "Access denied"   # …and this substring of the first bodyLimitKiB
//	    hosts: [shop.example.com]   # only for these targets (default: any)
//	    retry: true             # retry idempotent requests on another proxy (default true)
//
// A rule matches when every condition it sets holds; the first matching
// rule, in file order, wins. A rule must set at least one condition.
// Unknown keys are refused with their path.
package rules

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"reflect"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Outcome is what a rule says of a response.
type Outcome string

// The outcomes a rule may give; None is no rule matching.
const (
	None    Outcome = ""
	Banned  Outcome = "banned"
	Blocked Outcome = "blocked"
	Captcha Outcome = "captcha"
)

// DefaultBodyLimitKiB is how much of a body the rules read by default.
const DefaultBodyLimitKiB = 64

// Header is a header condition: the header is present and, when Contains
// is set, one of its values contains it (case-insensitively).
type Header struct {
	Name     string `yaml:"name"`
	Contains string `yaml:"contains"`
}

// Rule is one classification.
type Rule struct {
	Name    string   `yaml:"name"`
	Outcome Outcome  `yaml:"outcome"`
	Status  []int    `yaml:"status"`
	Header  *Header  `yaml:"header"`
	Body    string   `yaml:"body"`
	Hosts   []string `yaml:"hosts"`
	Retry   *bool    `yaml:"retry"`
}

// Set is a parsed rules file.
type Set struct {
	BodyLimitKiB int    `yaml:"bodyLimitKiB"`
	Rules        []Rule `yaml:"rules"`
}

// Match is the rule that matched a response.
type Match struct {
	Rule    string
	Outcome Outcome
	Retry   bool
}

// LoadFile reads a rules file.
func LoadFile(path string) (*Set, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("rules file: %w", err)
	}
	s, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("rules file %s: %w", path, err)
	}
	return s, nil
}

// Parse validates a rules document. An empty document is no rules.
func Parse(data []byte) (*Set, error) {
	s := &Set{}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("not YAML: %w", err)
	}
	if len(doc.Content) > 0 {
		if err := checkKnown(doc.Content[0], reflect.TypeOf(Set{}), ""); err != nil {
			return nil, err
		}
		if err := doc.Content[0].Decode(s); err != nil {
			return nil, err
		}
	}
	switch {
	case s.BodyLimitKiB == 0:
		s.BodyLimitKiB = DefaultBodyLimitKiB
	case s.BodyLimitKiB < 0 || s.BodyLimitKiB > 1024:
		return nil, errors.New("bodyLimitKiB: want 1 to 1024")
	}
	names := map[string]bool{}
	for i := range s.Rules {
		r := &s.Rules[i]
		path := fmt.Sprintf("rules[%d]", i)
		switch {
		case r.Name == "":
			return nil, fmt.Errorf("%s.name: required", path)
		case names[r.Name]:
			return nil, fmt.Errorf("%s.name: %q is used twice", path, r.Name)
		}
		names[r.Name] = true
		switch r.Outcome {
		case Banned, Blocked, Captcha:
		default:
			return nil, fmt.Errorf("%s.outcome: %q: want banned, blocked or captcha", path, r.Outcome)
		}
		for j, c := range r.Status {
			if c < 100 || c > 599 {
				return nil, fmt.Errorf("%s.status[%d]: %d is no HTTP status", path, j, c)
			}
		}
		if r.Header != nil && http.CanonicalHeaderKey(strings.TrimSpace(r.Header.Name)) == "" {
			return nil, fmt.Errorf("%s.header.name: required", path)
		}
		if len(r.Status) == 0 && r.Header == nil && r.Body == "" {
			return nil, fmt.Errorf("%s: set at least one of status, header, body", path)
		}
		if len(r.Body) > s.BodyLimitKiB<<10 {
			return nil, fmt.Errorf("%s.body: longer than bodyLimitKiB", path)
		}
		for j, h := range r.Hosts {
			r.Hosts[j] = strings.TrimSuffix(strings.ToLower(strings.TrimSpace(h)), ".")
			if r.Hosts[j] == "" {
				return nil, fmt.Errorf("%s.hosts[%d]: empty", path, j)
			}
		}
	}
	return s, nil
}

// checkKnown reports the first key of node that type t has no field for,
// with its path.
func checkKnown(node *yaml.Node, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	join := func(k string) string {
		if path == "" {
			return k
		}
		return path + "." + k
	}
	switch {
	case t.Kind() == reflect.Struct && node.Kind == yaml.MappingNode:
		for i := 0; i+1 < len(node.Content); i += 2 {
			key := node.Content[i].Value
			f, ok := fieldByTag(t, key)
			if !ok {
				return fmt.Errorf("%s: unknown field (line %d)", join(key), node.Content[i].Line)
			}
			if err := checkKnown(node.Content[i+1], f, join(key)); err != nil {
				return err
			}
		}
	case t.Kind() == reflect.Slice && node.Kind == yaml.SequenceNode:
		for i, el := range node.Content {
			if err := checkKnown(el, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	}
	return nil
}

func fieldByTag(t reflect.Type, key string) (reflect.Type, bool) {
	for i := range t.NumField() {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ","); name == key {
			return t.Field(i).Type, true
		}
	}
	return nil, false
}

// Empty reports whether the set has no rules.
func (s *Set) Empty() bool { return s == nil || len(s.Rules) == 0 }

// NeedsBody reports whether a rule that could match host and status reads
// the body.
func (s *Set) NeedsBody(host string, status int) bool {
	if s == nil {
		return false
	}
	for i := range s.Rules {
		r := &s.Rules[i]
		if r.Body != "" && r.forHost(host) && r.statusMatches(status) {
			return true
		}
	}
	return false
}

// BodyLimit is how many bytes of a body the rules read.
func (s *Set) BodyLimit() int {
	if s == nil {
		return 0
	}
	return s.BodyLimitKiB << 10
}

// Classify returns the first rule matching a response from host with
// status, header and the first BodyLimit bytes of its body (nil when no
// rule needed it).
func (s *Set) Classify(host string, status int, header http.Header, body []byte) (Match, bool) {
	if s == nil {
		return Match{}, false
	}
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	for i := range s.Rules {
		r := &s.Rules[i]
		if !r.forHost(host) || !r.statusMatches(status) {
			continue
		}
		if r.Header != nil && !headerMatches(header, r.Header) {
			continue
		}
		if r.Body != "" && !bytes.Contains(body, []byte(r.Body)) {
			continue
		}
		return Match{Rule: r.Name, Outcome: r.Outcome, Retry: r.Retry == nil || *r.Retry}, true
	}
	return Match{}, false
}

func (r *Rule) forHost(host string) bool {
	if len(r.Hosts) == 0 {
		return true
	}
	for _, h := range r.Hosts {
		if h == host {
			return true
		}
	}
	return false
}

func (r *Rule) statusMatches(status int) bool {
	if len(r.Status) == 0 {
		return true
	}
	for _, c := range r.Status {
		if c == status {
			return true
		}
	}
	return false
}

func headerMatches(h http.Header, want *Header) bool {
	values := h.Values(want.Name)
	if len(values) == 0 {
		return false
	}
	if want.Contains == "" {
		return true
	}
	needle := strings.ToLower(want.Contains)
	for _, v := range values {
		if strings.Contains(strings.ToLower(v), needle) {
			return true
		}
	}
	return false
}

// ReadPrefix reads up to limit bytes of body and returns them with a body
// that yields those bytes again followed by the rest.
func ReadPrefix(body io.ReadCloser, limit int) ([]byte, io.ReadCloser, error) {
	buf := make([]byte, limit)
	n, err := io.ReadFull(body, buf)
	buf = buf[:n]
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		return buf, body, err
	}
	return buf, struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(buf), body), body}, nil
}
