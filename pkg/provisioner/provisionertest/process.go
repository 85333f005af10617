package provisionertest

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
)

// Binary is a provisioner's main package, run as a real process the way it
// runs in production: its flags, its providers file, its token file.
type Binary struct {
	// Package is the main package's directory relative to the test, as
	// proctest.Build takes it ("." from the service's own tests).
	Package string
	// Service is the binary's service name (provisioner-<backend>).
	Service string
}

// Provider is one entry of a providers file.
type Provider struct {
	Name, Type string
	// Block is the backend's block, unindented, its first line the type's
	// key ("gcp:"); empty for a provider without one.
	Block string
}

// ProvidersFile writes a providers file holding ps into a directory of
// the test's and returns its path.
func ProvidersFile(t testing.TB, ps ...Provider) string {
	t.Helper()
	var b strings.Builder
	b.WriteString("providers:\n")
	for _, p := range ps {
		b.WriteString("  - name: " + p.Name + "\n    type: " + p.Type + "\n")
		for _, line := range strings.Split(strings.TrimRight(p.Block, "\n"), "\n") {
			if line != "" {
				b.WriteString("    " + line + "\n")
			}
		}
	}
	return WriteFile(t, "providers.yaml", b.String())
}

// WriteFile writes content to a file named name in a directory of its own
// under the test's temporary directory and returns its path.
func WriteFile(t testing.TB, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Provisioner is a started provisioner process serving one provider, with
// a client of its gRPC API that holds the service role.
type Provisioner struct {
	*proctest.Process
	// GRPC and HTTP are where it listens.
	GRPC, HTTP string
	// Client calls its ProvisionerService with the service token.
	Client provisionerv1.ProvisionerServiceClient
	// Conn is the client's connection (for other services on the port).
	Conn *grpc.ClientConn
}

// StartOptions adjust Start.
type StartOptions struct {
	// NATSURL is the NATS server; empty: a URL nothing listens on (the
	// provisioner serves gRPC without NATS).
	NATSURL string
	// Args are more flags.
	Args []string
	// Env are more KEY=VALUE variables.
	Env []string
	// Tags are build tags of the binary.
	Tags []string
}

// Start builds the binary (once per test binary and tags) and starts it
// on loopback ports serving p, with a token file granting a token the
// service role, and waits until it serves.
func (b Binary) Start(t *testing.T, p Provider, o StartOptions) *Provisioner {
	t.Helper()
	token := randomHex(16)
	natsURL := o.NATSURL
	if natsURL == "" {
		natsURL = natstest.DownURL(t)
	}
	args := append([]string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0",
		"--providers-config=" + ProvidersFile(t, p), "--provider=" + p.Name, "--nats-url=" + natsURL,
		"--auth-token-file=" + WriteFile(t, "api-tokens", "conformance "+token+" service\n")}, o.Args...)
	proc := proctest.Start(t, proctest.Build(t, b.Package, o.Tags...), args, o.Env...)
	serving := proc.WaitLog(t, 2*time.Minute, proctest.Msg("serving"))
	out := &Provisioner{Process: proc}
	out.GRPC, _ = serving["grpc"].(string)
	out.HTTP, _ = serving["http"].(string)
	out.Conn = grpctest.Dial(t, out.GRPC, grpc.WithPerRPCCredentials(auth.BearerToken(token)))
	out.Client = provisionerv1.NewProvisionerServiceClient(out.Conn)
	return out
}

// AssertLifecycle checks what every service binary promises
// (servicetest.AssertLifecycle) of the binary serving p, once with NATS
// up and once with NATS down.
func (b Binary) AssertLifecycle(t *testing.T, p Provider) {
	t.Helper()
	cfg := ProvidersFile(t, p)
	tokens := WriteFile(t, "api-tokens", "health "+randomHex(16)+" service\n")
	for name, natsURL := range map[string]string{"NATS up": natstest.New(t).URL(), "NATS down": natstest.DownURL(t)} {
		t.Run(name, func(t *testing.T) {
			servicetest.AssertLifecycle(t, b.Package, b.Service, []string{"--providers-config=" + cfg, "--provider=" + p.Name,
				"--nats-url=" + natsURL, "--nats-prefix=lc", "--auth-token-file=" + tokens})
		})
	}
}

// Refusal is a configuration a provisioner must refuse at start: it exits
// 1 at once, saying Want.
type Refusal struct {
	Name string
	// Providers are the providers file's entries.
	Providers []Provider
	// Provider is --provider; empty: the flag is not given.
	Provider string
	// Want is in the output.
	Want string
}

// AssertRefuses starts the binary with each refused configuration, in
// parallel.
func (b Binary) AssertRefuses(t *testing.T, cases []Refusal) {
	t.Helper()
	natsURL := natstest.New(t).URL()
	bin := proctest.Build(t, b.Package)
	for _, tc := range cases {
		t.Run(tc.Name, func(t *testing.T) {
			t.Parallel()
			args := []string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0", "--nats-url=" + natsURL, "--auth-disabled",
				"--providers-config=" + ProvidersFile(t, tc.Providers...)}
			if tc.Provider != "" {
				args = append(args, "--provider="+tc.Provider)
			}
			p := proctest.Start(t, bin, args)
			if code := p.Wait(t, time.Minute); code != 1 {
				t.Errorf("exit code %d, want 1", code)
			}
			if !strings.Contains(p.Output(), tc.Want) {
				t.Errorf("output lacks %q:\n%s", tc.Want, p.Output())
			}
		})
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// VerifyNoLeaks runs the package's tests and fails them when a goroutine
// outlives them (goleak), past the idle connections of net/http's
// default transport, which the process tests' HTTP checks leave to it.
func VerifyNoLeaks(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
}
