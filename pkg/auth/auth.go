// Package auth authenticates API callers with bearer tokens read from a
// mounted file and authorizes every call against one table of roles per
// RPC (table.go).
//
// Each line of the token file is
//
//	<client-id> <token> <role>[,<role>…]
//
// with roles from admin, viewer, crawler and service. Blank lines and lines
// starting with '#' are ignored. A line of only `<client-id> <token>` (the
// format before roles existed) is refused: such a token used to be allowed
// everything, and guessing a role for it would either lock its client out
// or silently keep that power. The file is re-read when it changes (checked
// at most once a second), so a rotated Secret takes effect without a
// restart; a rewrite that does not parse keeps the last good tokens and is
// logged as a WARNING.
//
// gRPC health (and reflection, when a service turns it on) is exempt, and
// so is everything on the HTTP port that is not the REST layer (/healthz,
// /readyz, /metrics): the REST layer forwards the Authorization header to the
// gRPC server, where the check happens once for both transports. The
// REST layer's HTTP handler also checks the token (HTTPMiddleware) before it
// reads a request body, so an anonymous caller cannot make a service read
// one.
//
// Tokens never appear in logs or errors.
package auth

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/egress-proxies/egress-proxies/pkg/reload"
)

// Anonymous is the client id of every call when authentication is disabled.
const Anonymous = "anonymous"

// Config selects how a service authenticates.
type Config struct {
	// TokenFile holds `<client-id> <token> <role>[,<role>…]` lines.
	TokenFile string
	// Disabled accepts every call as Anonymous with every role. For local
	// use only.
	Disabled bool
}

// RegisterFlags adds --auth-token-file and --auth-disabled.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.TokenFile, "auth-token-file", c.TokenFile,
		"file of `<client-id> <token> <role>[,<role>…]` lines (roles: admin, viewer, crawler, service); callers send `Authorization: Bearer <token>`")
	fs.BoolVar(&c.Disabled, "auth-disabled", c.Disabled,
		"accept unauthenticated calls, with every role (local use only; logged as a WARNING)")
}

// Identity is an authenticated caller: its client id and roles.
type Identity struct {
	ClientID string
	Roles    []Role
}

// Has reports whether the identity holds role.
func (id Identity) Has(role Role) bool { return slices.Contains(id.Roles, role) }

// Authenticator checks bearer tokens against the token file.
type Authenticator struct {
	disabled bool
	log      *slog.Logger
	tokens   *reload.File[map[[sha256.Size]byte]Identity]

	limits *limiters // nil: no rate limits
}

// New builds an Authenticator from c. Exactly one of a token file or
// Disabled is required. With Disabled it logs a WARNING; a token file that
// cannot be read or parsed now is an error.
func New(c Config, log *slog.Logger) (*Authenticator, error) {
	switch {
	case c.Disabled && c.TokenFile != "":
		return nil, errors.New("--auth-disabled and --auth-token-file are mutually exclusive")
	case c.Disabled:
		log.Warn("WARNING: authentication is disabled; every caller is accepted as \"anonymous\" with every role. Never run like this outside a local machine.")
		return &Authenticator{disabled: true, log: log}, nil
	case c.TokenFile == "":
		return nil, errors.New("--auth-token-file is required (or --auth-disabled for local use)")
	}
	tokens, err := reload.Open(c.TokenFile, "the token file", parseTokens, log)
	if err != nil {
		return nil, err
	}
	return &Authenticator{tokens: tokens, log: log}, nil
}

// Disabled reports whether every call is accepted without a token.
func (a *Authenticator) Disabled() bool { return a.disabled }

var anonymous = Identity{ClientID: Anonymous, Roles: AllRoles()}

// Authenticate returns the caller for the Authorization header value.
func (a *Authenticator) Authenticate(header string) (Identity, error) {
	if a.disabled {
		return anonymous, nil
	}
	scheme, token, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "bearer") || strings.TrimSpace(token) == "" {
		return Identity{}, status.Error(codes.Unauthenticated, "missing bearer token: send `Authorization: Bearer <token>`")
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(token)))
	id, found := a.tokens.Current()[sum]
	if !found {
		return Identity{}, status.Error(codes.Unauthenticated, "invalid bearer token")
	}
	return id, nil
}

func parseTokens(data []byte) (map[[sha256.Size]byte]Identity, error) {
	out := map[[sha256.Size]byte]Identity{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		switch {
		case len(fields) == 2:
			return nil, fmt.Errorf("line %d: no roles; want `<client-id> <token> <role>[,<role>…]` with roles from %s", n, roleList(AllRoles()))
		case len(fields) != 3:
			return nil, fmt.Errorf("line %d: want `<client-id> <token> <role>[,<role>…]`", n)
		}
		roles, err := ParseRoles(fields[2])
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		sum := sha256.Sum256([]byte(fields[1]))
		if prev, dup := out[sum]; dup {
			return nil, fmt.Errorf("line %d: the same token is given again (first to client %q)", n, prev.ClientID)
		}
		out[sum] = Identity{ClientID: fields[0], Roles: roles}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no tokens")
	}
	return out, nil
}

type identityKey struct{}

// ClientID is the authenticated client of the call.
func ClientID(ctx context.Context) string {
	id, _ := ctx.Value(identityKey{}).(Identity)
	return id.ClientID
}

// IdentityOf is the authenticated caller of the call (the zero Identity
// when the call was not authenticated).
func IdentityOf(ctx context.Context) Identity {
	id, _ := ctx.Value(identityKey{}).(Identity)
	return id
}

// HasRole reports whether the caller of the call holds role (every role
// when authentication is disabled).
func HasRole(ctx context.Context, role Role) bool {
	id, _ := ctx.Value(identityKey{}).(Identity)
	return id.Has(role)
}

// WithIdentity returns ctx carrying id, for tests and in-process callers.
func WithIdentity(ctx context.Context, id Identity) context.Context {
	return context.WithValue(ctx, identityKey{}, id)
}

// WithClientID returns ctx carrying a caller with id and no roles, for
// tests and in-process callers.
func WithClientID(ctx context.Context, id string) context.Context {
	return WithIdentity(ctx, Identity{ClientID: id})
}

// BearerToken is a per-RPC credential sending a static token, for clients
// (egressctl, tests, service-to-service calls).
type BearerToken string

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (t BearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials; tokens
// may travel over plaintext loopback and in-cluster connections.
func (BearerToken) RequireTransportSecurity() bool { return false }
