package lifecycle

import (
	"errors"
	"regexp"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

var oldCredentials = &Credentials{Username: "egress-000000000000", Password: "old-password", Time: t0.Add(-time.Hour)}

func withCredentials(p *Proxy) { c := *oldCredentials; p.Credentials = &c }
func openSpec(p *Proxy)        { p.Spec.Credentials = proxyv1.CredentialsPolicy_CREDENTIALS_POLICY_NONE }
func stale(p *Proxy)           { p.CredentialsStale = true }

// credentialsChange says what became of a proxy's credentials.
type credentialsChange int

const (
	credsKept credentialsChange = iota
	credsNew
	credsNone
)

func (c credentialsChange) String() string { return [...]string{"kept", "new", "none"}[c] }

func changeOf(p *Proxy) credentialsChange {
	switch {
	case p.Credentials == nil:
		return credsNone
	case *p.Credentials == *oldCredentials:
		return credsKept
	default:
		return credsNew
	}
}

func TestGenerateCredentials(t *testing.T) {
	t.Parallel()
	a, b := GenerateCredentials(t0), GenerateCredentials(t0)
	if a.Username == b.Username || a.Password == b.Password {
		t.Error("two generated credentials share a user or password")
	}
	user := regexp.MustCompile(`^egress-[0-9a-f]{12}$`)
	pass := regexp.MustCompile(`^[A-Za-z0-9_-]{32}$`)
	if !user.MatchString(a.Username) || !pass.MatchString(a.Password) {
		t.Errorf("generated credentials do not have the documented shape (user %q)", a.Username)
	}
	if !a.Time.Equal(t0) {
		t.Errorf("time %v, want t0", a.Time)
	}
	if s := a.String(); s != "credentials(redacted)" {
		t.Errorf("String() = %q shows more than a redaction", s)
	}
}

// Every rule that makes, keeps or drops a proxy's credentials.
func TestCredentialsTable(t *testing.T) {
	t.Parallel()
	m := machine()
	cases := []struct {
		name string
		run  func(*testing.T) *Proxy
		want credentialsChange
		// wantStale is the proxy's CredentialsStale afterwards.
		wantStale bool
	}{
		{name: "new managed proxy: generated", want: credsNew, run: func(*testing.T) *Proxy {
			return New("p", nil, proxy().Spec, false, t0)
		}},
		{name: "new managed proxy with credentials NONE: none", want: credsNone, run: func(*testing.T) *Proxy {
			return New("p", nil, proxy(openSpec).Spec, false, t0)
		}},
		{name: "new external proxy without endpoint credentials: none", want: credsNone, run: func(*testing.T) *Proxy {
			return New("p", nil, proxy(external).Spec, false, t0)
		}},
		{name: "create of a proxy that has credentials: kept", want: credsKept, run: func(*testing.T) *Proxy {
			p := proxy(withCredentials)
			m.Decide(p, t0)
			return p
		}},
		{name: "create of a proxy from before credentials: generated", want: credsNew, run: func(*testing.T) *Proxy {
			p := proxy()
			m.Decide(p, t0)
			return p
		}},
		{name: "create of an open proxy: none", want: credsNone, run: func(*testing.T) *Proxy {
			p := proxy(openSpec)
			m.Decide(p, t0)
			return p
		}},
		{name: "create reissued past its deadline: kept", want: credsKept, run: func(*testing.T) *Proxy {
			p := proxy(withCredentials, inFlight(StepCreate, t0.Add(-time.Second)))
			m.Decide(p, t0)
			return p
		}},
		{name: "poll of a running instance: kept", want: credsKept, run: func(*testing.T) *Proxy {
			p := proxy(withInstance, withCredentials)
			cmd := m.Decide(p, t0).Command
			m.Apply(p, result(cmd, nil, runningInst), t0)
			return p
		}},
		{name: "instance lost: new ones for the next instance", want: credsNew, run: func(*testing.T) *Proxy {
			p := proxy(withInstance, withCredentials)
			cmd := m.Decide(p, t0).Command
			m.Apply(p, result(cmd, notFound, nil), t0)
			return p
		}},
		{name: "replaced for a spec change: new ones", want: credsNew, run: func(*testing.T) *Proxy {
			p := proxy(withInstance, withCredentials, specChanged)
			cmd := m.Decide(p, t0).Command
			m.Apply(p, result(cmd, notFound, nil), t0)
			return p
		}},
		{name: "replaced after the spec went to NONE: none", want: credsNone, run: func(*testing.T) *Proxy {
			p := proxy(withInstance, withCredentials, specChanged, openSpec)
			cmd := m.Decide(p, t0).Command
			m.Apply(p, result(cmd, notFound, nil), t0)
			return p
		}},
		{name: "rotated with an instance: new ones, instance stale", want: credsNew, wantStale: true, run: func(t *testing.T) *Proxy {
			p := proxy(withInstance, withCredentials)
			if err := RotateCredentials(p, "", t0); err != nil {
				t.Fatal(err)
			}
			return p
		}},
		{name: "rotated before any instance: new ones, nothing stale", want: credsNew, run: func(t *testing.T) *Proxy {
			p := proxy(withCredentials)
			if err := RotateCredentials(p, "", t0); err != nil {
				t.Fatal(err)
			}
			return p
		}},
		{name: "rotated while the create is in flight: the instance it makes is stale", want: credsNew, wantStale: true, run: func(t *testing.T) *Proxy {
			p := proxy(withCredentials, inFlight(StepCreate, t0.Add(time.Minute)))
			if err := RotateCredentials(p, "", t0); err != nil {
				t.Fatal(err)
			}
			return p
		}},
		{name: "rotation's replacement completes: the new ones stay, nothing stale", want: credsNew, run: func(*testing.T) *Proxy {
			p := proxy(withInstance, stale)
			p.Credentials = GenerateCredentials(t0)
			rotated := *p.Credentials
			cmd := m.Decide(p, t0).Command
			m.Apply(p, result(cmd, notFound, nil), t0)
			// The replacement gets credentials of its own, again new.
			if *p.Credentials == rotated {
				p.Credentials = oldCredentials
			}
			return p
		}},
		{name: "external update with endpoint credentials: replaced", want: credsNew, run: func(*testing.T) *Proxy {
			p := proxy(external, withCredentials)
			want := proxy(external).Spec
			want.EndpointCredentials = &proxyv1.ProxyCredentials{Username: "u", Password: "p"}
			Update(p, want, nil, false, "", t0)
			if want.EndpointCredentials != nil {
				p.Credentials = oldCredentials // the spec kept them: fail below
			}
			return p
		}},
		{name: "external update without endpoint credentials: kept", want: credsKept, run: func(*testing.T) *Proxy {
			p := proxy(external, withCredentials)
			Update(p, proxy(external).Spec, nil, false, "", t0)
			return p
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := tc.run(t)
			if got := changeOf(p); got != tc.want {
				t.Errorf("credentials %v, want %v", got, tc.want)
			}
			if p.CredentialsStale != tc.wantStale {
				t.Errorf("stale = %v, want %v", p.CredentialsStale, tc.wantStale)
			}
		})
	}
}

// A stale instance takes the new credentials in place, or is replaced
// where its provider cannot; what RotateCredentials refuses.
func TestRotateCredentials(t *testing.T) {
	t.Parallel()
	t.Run("stale instance: updated in place", func(t *testing.T) {
		t.Parallel()
		m := machine()
		p := proxy(withInstance, healthy, withCredentials, stale)
		dec := m.Decide(p, t0)
		if dec.Command.GetOperation() != opUpdate || p.CommandStep != StepUpdateCredentials || p.Phase != provisioning || p.Reason != ReasonRotatingCredentials {
			t.Fatalf("op %v step %v phase %v reason %q, want an in-place update for RotatingCredentials, PROVISIONING",
				dec.Command.GetOperation(), p.CommandStep, p.Phase, p.Reason)
		}
		if req := dec.Command.GetUpdateCredentials(); req.GetProviderId() != p.ProviderID || req.GetProxyUid() != p.UID || req.GetCredentials() != nil {
			t.Errorf("request %v: want the instance, and no credentials on the command", req)
		}
		rotated := *p.Credentials
		m.Apply(p, result(dec.Command, nil, runningInst), t0)
		if p.CredentialsStale || p.Healthy || p.Phase != running || p.ProviderID != runningInst.GetProviderId() || *p.Credentials != rotated {
			t.Errorf("after the update: stale %v, healthy %v, phase %v, provider id %q, credentials kept %v; want current, unprobed, RUNNING, the same instance and credentials",
				p.CredentialsStale, p.Healthy, p.Phase, p.ProviderID, *p.Credentials == rotated)
		}
	})
	t.Run("provider cannot update in place: delete to replace", func(t *testing.T) {
		t.Parallel()
		m := machine()
		p := proxy(withInstance, healthy, withCredentials, stale)
		m.Apply(p, result(m.Decide(p, t0).Command, unsupported, nil), t0)
		if !p.CredentialsStale || p.NextAttemptTime == nil || p.NextAttemptTime.After(t0) || p.Phase == failed {
			t.Fatalf("after Unsupported: stale %v, next %v, phase %v; want stale, due now, not FAILED", p.CredentialsStale, in(p.NextAttemptTime, t0), p.Phase)
		}
		dec := m.Decide(p, t0)
		if dec.Command.GetOperation() != opDelete || p.CommandStep != StepReplaceDelete || p.Reason != ReasonRotatingCredentials {
			t.Errorf("op %v step %v reason %q, want a replacing delete for RotatingCredentials", dec.Command.GetOperation(), p.CommandStep, p.Reason)
		}
	})
	t.Run("update failed transiently: tried again in place", func(t *testing.T) {
		t.Parallel()
		m := machine()
		p := proxy(withInstance, withCredentials, stale)
		m.Apply(p, result(m.Decide(p, t0).Command, transient, nil), t0)
		if !p.CredentialsStale || p.Reason != ReasonRetrying {
			t.Fatalf("after a transient failure: stale %v reason %q", p.CredentialsStale, p.Reason)
		}
		if dec := m.Decide(p, *p.NextAttemptTime); dec.Command.GetOperation() != opUpdate {
			t.Errorf("the retry is %v, want the in-place update again", dec.Command.GetOperation())
		}
	})
	t.Run("a Ready proxy is not Ready from the rotation's own write", func(t *testing.T) {
		t.Parallel()
		p := proxy(withInstance, healthy, withCredentials, func(p *Proxy) { p.Phase = ready })
		old := p.Credentials
		if err := RotateCredentials(p, "", t0); err != nil {
			t.Fatal(err)
		}
		if p.Credentials == old || !p.CredentialsStale || p.Phase != provisioning || p.Reason != ReasonRotatingCredentials {
			t.Errorf("after rotating: new credentials %v, stale %v, phase %v, reason %q; want new, stale, PROVISIONING, RotatingCredentials",
				p.Credentials != old, p.CredentialsStale, p.Phase, p.Reason)
		}
	})
	refusals := []struct {
		name  string
		proxy *Proxy
		want  error
	}{
		{"external", proxy(external), ErrRotateExternal},
		{"credentials NONE", proxy(openSpec), ErrRotateNone},
		{"deleting", proxy(withInstance, withCredentials, deleting), ErrRotateDeleting},
	}
	for _, tc := range refusals {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			before := *tc.proxy
			if err := RotateCredentials(tc.proxy, "", t0); !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if tc.proxy.Credentials != before.Credentials || tc.proxy.CredentialsStale || tc.proxy.NextAttemptTime != before.NextAttemptTime {
				t.Error("a refused rotation changed the proxy")
			}
		})
	}
}
