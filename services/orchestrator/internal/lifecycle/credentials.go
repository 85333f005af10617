package lifecycle

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Credentials are a proxy's HTTP Basic Proxy-Authorization user and
// password: made here for a MANAGED proxy, given by the client for an
// EXTERNAL one. Secret: the store keeps them sealed, and nothing renders
// them but GetProxyCredentials.
type Credentials struct {
	Username string
	Password string
	// Time is when they were made (or stored, for an EXTERNAL proxy).
	Time time.Time
}

// String never shows the secret, so a Credentials that reaches a log by
// mistake says nothing.
func (c *Credentials) String() string { return "credentials(redacted)" }

// GenerateCredentials makes random credentials from crypto/rand: a user
// "egress-" followed by 12 hex digits and a password of 32 base64url
// characters (192 bits).
func GenerateCredentials(now time.Time) *Credentials {
	user := make([]byte, 6)
	pass := make([]byte, 24)
	// crypto/rand.Read never fails (it crashes the program instead).
	_, _ = rand.Read(user)
	_, _ = rand.Read(pass)
	return &Credentials{
		Username: "egress-" + hex.EncodeToString(user),
		Password: base64.RawURLEncoding.EncodeToString(pass),
		Time:     now,
	}
}

// WantsCredentials reports whether a proxy of spec s has generated
// credentials: a MANAGED proxy whose spec does not say NONE.
func WantsCredentials(s *proxyv1.ProxySpec) bool {
	return s.GetMode() == proxyv1.ProxyMode_PROXY_MODE_MANAGED &&
		s.GetCredentials() != proxyv1.CredentialsPolicy_CREDENTIALS_POLICY_NONE
}

// takeEndpointCredentials moves an EXTERNAL spec's endpoint credentials
// onto p (the stored spec never holds them); a spec without any leaves p's
// as they are.
func takeEndpointCredentials(p *Proxy, want *proxyv1.ProxySpec, now time.Time) {
	c := want.GetEndpointCredentials()
	if c == nil {
		return
	}
	want.EndpointCredentials = nil
	p.Credentials = &Credentials{Username: c.GetUsername(), Password: c.GetPassword(), Time: now}
}

// renewCredentials gives p new credentials for the instance about to be
// created in place of one that is gone, when its spec wants them, and
// drops them when it no longer does.
func renewCredentials(p *Proxy, now time.Time) {
	if WantsCredentials(p.Spec) {
		p.Credentials = GenerateCredentials(now)
	} else {
		p.Credentials = nil
	}
	p.CredentialsStale = false
}

// A proxy's status messages while its instance takes rotated credentials:
// in place first, by replacement where the provider cannot.
const (
	rotatingInPlaceMessage = "the credentials were rotated; changing them on the instance so that the old ones stop working"
	rotatingMessage        = "the credentials were rotated; replacing the instance so that the old ones stop working"
)

// Errors of RotateCredentials, each a refusal the caller reports as a
// failed precondition.
var (
	ErrRotateExternal = errors.New("an EXTERNAL proxy's credentials are its own: update spec.endpoint_credentials instead")
	ErrRotateNone     = errors.New("the proxy's spec.credentials is CREDENTIALS_POLICY_NONE: it has no credentials to rotate")
	ErrRotateDeleting = errors.New("the proxy is being deleted")
)

// RotateCredentials gives p new credentials and makes the old ones stop
// working: the instance is marked as running with stale credentials, and
// the next decision changes them (by replacing the instance, or in place
// where the provider can). A proxy with no instance yet simply creates it
// with the new ones.
func RotateCredentials(p *Proxy, traceParent string, now time.Time) error {
	switch {
	case p.Deleting():
		return ErrRotateDeleting
	case p.Spec.GetMode() == proxyv1.ProxyMode_PROXY_MODE_EXTERNAL:
		return ErrRotateExternal
	case !WantsCredentials(p.Spec):
		return ErrRotateNone
	}
	p.Credentials = GenerateCredentials(now)
	p.CredentialsStale = p.ProviderID != "" || p.CommandStep == StepCreate
	if p.CredentialsStale {
		// Not Ready from this write on: the instance demands the old
		// credentials until it is replaced, so the new ones must not be
		// handed out with leases (or probed with) before then.
		p.setPhase(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING, now)
		p.Reason, p.Message = ReasonRotatingCredentials, rotatingMessage
	}
	p.TraceParent = traceParent
	if p.CommandID == "" {
		p.NextAttemptTime = &now
		p.Attempts = 0
	}
	return nil
}
