// Package access decides who may use the gateway: it checks the client
// token carried as the password of the proxy credentials against the
// suite's token file (role crawler), parses the username's options, and
// slows down sources that keep failing. It also holds the tunnel limits.
package access

import (
	"encoding/base64"
	"errors"
	"net"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/options"
)

// Reason says why credentials were refused; it is a metric label.
type Reason string

// The reasons.
const (
	Missing     Reason = "missing"
	Invalid     Reason = "invalid"
	NoRole      Reason = "role"
	RateLimited Reason = "rate_limited"
)

// Refused is a refusal of credentials.
type Refused struct{ Reason Reason }

func (r *Refused) Error() string {
	switch r.Reason {
	case Missing:
		return "proxy credentials required: send user (options, may be empty) and password (your client token)"
	case RateLimited:
		return "too many failed attempts from this address; try again later"
	case NoRole:
		return "this client token does not hold the crawler role"
	default:
		return "invalid proxy credentials"
	}
}

// Caller is an admitted caller.
type Caller struct {
	ClientID string
	Options  options.Options
}

// Checker admits callers.
type Checker struct {
	authn *auth.Authenticator

	mu       sync.Mutex
	failures map[string]*entry
	limit    rate.Limit
	burst    int
	now      func() time.Time
}

type entry struct {
	lim  *rate.Limiter
	seen time.Time
}

// NewChecker admits callers whose token authn knows; each source address
// may fail perMinute times a minute (burst of the same size) before every
// attempt of it is refused as rate limited.
func NewChecker(authn *auth.Authenticator, perMinute int) *Checker {
	if perMinute <= 0 {
		perMinute = 1
	}
	return &Checker{
		authn: authn, failures: map[string]*entry{},
		limit: rate.Limit(float64(perMinute) / 60), burst: perMinute, now: time.Now,
	}
}

// Disabled reports whether authentication is off (every caller is the
// anonymous client).
func (c *Checker) Disabled() bool { return c.authn.Disabled() }

// Check admits user and password from source (a remote address,
// host:port). A refusal is a *Refused; bad options an *options.Error,
// checked only once the token is good, so an anonymous caller learns
// nothing of the grammar.
func (c *Checker) Check(source, user, password string, present bool) (Caller, error) {
	host := sourceHost(source)
	if c.blocked(host) {
		return Caller{}, &Refused{Reason: RateLimited}
	}
	var id auth.Identity
	switch {
	case c.authn.Disabled():
		id = auth.Identity{ClientID: auth.Anonymous, Roles: auth.AllRoles()}
	case !present || password == "":
		// A client that sent nothing yet is usually asking for the
		// challenge: not a failure to slow down.
		return Caller{}, &Refused{Reason: Missing}
	default:
		var err error
		id, err = c.authn.Authenticate("Bearer " + password)
		if err != nil {
			c.fail(host)
			return Caller{}, &Refused{Reason: Invalid}
		}
		if !id.Has(auth.Crawler) {
			c.fail(host)
			return Caller{}, &Refused{Reason: NoRole}
		}
	}
	o, err := options.Parse(user)
	if err != nil {
		return Caller{}, err
	}
	return Caller{ClientID: id.ClientID, Options: o}, nil
}

// ParseBasic reads a Proxy-Authorization header value.
func ParseBasic(header string) (user, password string, ok bool) {
	scheme, rest, found := strings.Cut(strings.TrimSpace(header), " ")
	if !found || !strings.EqualFold(scheme, "basic") {
		return "", "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(rest))
	if err != nil {
		return "", "", false
	}
	user, password, ok = strings.Cut(string(raw), ":")
	return user, password, ok
}

func sourceHost(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return addr
}

// blocked reports whether host has used up its failures.
func (c *Checker) blocked(host string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.failures[host]
	return ok && e.lim.TokensAt(c.now()) < 1
}

func (c *Checker) fail(host string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	e, ok := c.failures[host]
	if !ok {
		if len(c.failures) >= maxSources {
			c.sweep(now)
		}
		e = &entry{lim: rate.NewLimiter(c.limit, c.burst)}
		c.failures[host] = e
	}
	e.seen = now
	e.lim.AllowN(now, 1)
}

// maxSources bounds the failure table; a full table forgets the sources
// whose limiter has refilled, then the oldest.
const maxSources = 65536

func (c *Checker) sweep(now time.Time) {
	var oldest string
	var oldestSeen time.Time
	for h, e := range c.failures {
		if e.lim.TokensAt(now) >= float64(c.burst) {
			delete(c.failures, h)
			continue
		}
		if oldest == "" || e.seen.Before(oldestSeen) {
			oldest, oldestSeen = h, e.seen
		}
	}
	if len(c.failures) >= maxSources {
		delete(c.failures, oldest)
	}
}

// Limits bounds the tunnels open at once.
type Limits struct {
	mu        sync.Mutex
	total     int
	perClient map[string]int
	maxTotal  int
	maxClient int
}

// ErrTooManyTunnels and ErrTooManyClientTunnels are the refusals of Open.
var (
	ErrTooManyTunnels       = errors.New("the gateway has as many tunnels open as it allows; try again later")
	ErrTooManyClientTunnels = errors.New("this client has as many tunnels open as it may; close one first")
)

// NewLimits allows maxTotal tunnels in all and maxClient per client (0: no
// limit).
func NewLimits(maxTotal, maxClient int) *Limits {
	return &Limits{perClient: map[string]int{}, maxTotal: maxTotal, maxClient: maxClient}
}

// Open counts a tunnel of client, or refuses it; the returned func ends it.
func (l *Limits) Open(client string) (func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.maxTotal > 0 && l.total >= l.maxTotal {
		return nil, ErrTooManyTunnels
	}
	if l.maxClient > 0 && l.perClient[client] >= l.maxClient {
		return nil, ErrTooManyClientTunnels
	}
	l.total++
	l.perClient[client]++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.total--
			if l.perClient[client]--; l.perClient[client] <= 0 {
				delete(l.perClient, client)
			}
		})
	}, nil
}

// Active is the number of open tunnels.
func (l *Limits) Active() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total
}
