// Package auth authenticates API callers with bearer tokens read from a
// mounted file. Each line of the file is `<client-id> <token>`; blank lines
// and lines starting with '#' are ignored. The file is re-read when it
// changes (checked at most once a second), so a rotated Secret takes effect
// without a restart. The client id of a call is available to handlers
// through ClientID.
//
// gRPC health and reflection are exempt, and so is everything on the HTTP
// port that is not the gateway (/healthz, /readyz, /metrics): the gateway
// forwards the Authorization header to the gRPC server, where the check
// happens once for both transports.
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
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Anonymous is the client id of every call when authentication is disabled.
const Anonymous = "anonymous"

// Config selects how a service authenticates.
type Config struct {
	// TokenFile holds `<client-id> <token>` lines.
	TokenFile string
	// Disabled accepts every call as Anonymous. For local use only.
	Disabled bool
}

// RegisterFlags adds --auth-token-file and --auth-disabled.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.TokenFile, "auth-token-file", c.TokenFile,
		"file of `<client-id> <token>` lines; callers send `Authorization: Bearer <token>`")
	fs.BoolVar(&c.Disabled, "auth-disabled", c.Disabled,
		"accept unauthenticated calls (local use only; logged as a WARNING)")
}

// Authenticator checks bearer tokens against the token file.
type Authenticator struct {
	path     string
	disabled bool
	now      func() time.Time

	mu        sync.Mutex
	checked   time.Time
	modTime   time.Time
	size      int64
	byHash    map[[sha256.Size]byte]string
	loadError error
}

// New builds an Authenticator from c. Exactly one of a token file or
// Disabled is required. With Disabled it logs a WARNING; a token file that
// cannot be read or parsed now is an error.
func New(c Config, log *slog.Logger) (*Authenticator, error) {
	switch {
	case c.Disabled && c.TokenFile != "":
		return nil, errors.New("--auth-disabled and --auth-token-file are mutually exclusive")
	case c.Disabled:
		log.Warn("WARNING: authentication is disabled; every caller is accepted as \"anonymous\". Never run like this outside a local machine.")
		return &Authenticator{disabled: true}, nil
	case c.TokenFile == "":
		return nil, errors.New("--auth-token-file is required (or --auth-disabled for local use)")
	}
	a := &Authenticator{path: c.TokenFile, now: time.Now}
	if err := a.reload(true); err != nil {
		return nil, err
	}
	return a, nil
}

// Authenticate returns the client id for the Authorization header value.
func (a *Authenticator) Authenticate(header string) (string, error) {
	if a.disabled {
		return Anonymous, nil
	}
	scheme, token, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "bearer") || strings.TrimSpace(token) == "" {
		return "", status.Error(codes.Unauthenticated, "missing bearer token: send `Authorization: Bearer <token>`")
	}
	if err := a.reload(false); err != nil {
		return "", status.Error(codes.Unavailable, "the token file cannot be read; see the service log")
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(token)))
	a.mu.Lock()
	client, found := a.byHash[sum]
	a.mu.Unlock()
	if !found {
		return "", status.Error(codes.Unauthenticated, "invalid bearer token")
	}
	return client, nil
}

// reload re-reads the token file when its size or modification time
// changed, at most once a second unless forced. A file that becomes
// unreadable keeps the last good tokens.
func (a *Authenticator) reload(force bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	if !force && now.Sub(a.checked) < time.Second {
		return nil
	}
	a.checked = now
	fi, err := os.Stat(a.path)
	if err != nil {
		if a.byHash != nil {
			return nil
		}
		return fmt.Errorf("token file: %w", err)
	}
	if !force && fi.ModTime().Equal(a.modTime) && fi.Size() == a.size {
		return nil
	}
	data, err := os.ReadFile(a.path)
	if err != nil {
		if a.byHash != nil {
			return nil
		}
		return fmt.Errorf("token file: %w", err)
	}
	tokens, err := parseTokens(data)
	if err != nil {
		if a.byHash != nil {
			return nil
		}
		return fmt.Errorf("token file %s: %w", a.path, err)
	}
	a.byHash, a.modTime, a.size = tokens, fi.ModTime(), fi.Size()
	return nil
}

func parseTokens(data []byte) (map[[sha256.Size]byte]string, error) {
	out := map[[sha256.Size]byte]string{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 {
			return nil, fmt.Errorf("line %d: want `<client-id> <token>`", n)
		}
		sum := sha256.Sum256([]byte(fields[1]))
		if prev, dup := out[sum]; dup && prev != fields[0] {
			return nil, fmt.Errorf("line %d: the same token is given to clients %q and %q", n, prev, fields[0])
		}
		out[sum] = fields[0]
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no tokens")
	}
	return out, nil
}

type clientKey struct{}

// ClientID is the authenticated client of the call.
func ClientID(ctx context.Context) string {
	id, _ := ctx.Value(clientKey{}).(string)
	return id
}

// WithClientID returns ctx carrying id, for tests and in-process callers.
func WithClientID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, clientKey{}, id)
}

func exempt(fullMethod string) bool {
	return strings.HasPrefix(fullMethod, "/"+healthpb.Health_ServiceDesc.ServiceName+"/") ||
		strings.HasPrefix(fullMethod, "/grpc.reflection.")
}

func (a *Authenticator) authenticate(ctx context.Context, fullMethod string) (context.Context, error) {
	if exempt(fullMethod) {
		return ctx, nil
	}
	var header string
	// One header, read without copying the whole metadata map.
	if v := metadata.ValueFromIncomingContext(ctx, "authorization"); len(v) > 0 {
		header = v[0]
	}
	client, err := a.Authenticate(header)
	if err != nil {
		return nil, err
	}
	return WithClientID(ctx, client), nil
}

// ServerOptions returns the interceptors that enforce authentication.
func (a *Authenticator) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			ctx, err := a.authenticate(ctx, info.FullMethod)
			if err != nil {
				return nil, err
			}
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			ctx, err := a.authenticate(ss.Context(), info.FullMethod)
			if err != nil {
				return err
			}
			return h(srv, &authedStream{ServerStream: ss, ctx: ctx})
		}),
	}
}

type authedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *authedStream) Context() context.Context { return s.ctx }

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
