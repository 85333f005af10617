// Package servicetest checks what every service binary promises: it starts,
// serves grpc.health.v1 and Prometheus /metrics, logs JSON through slog, and
// exits cleanly on SIGTERM; and how every REST API answers bad input.
package servicetest

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
)

// Addrs are where a started service listens.
type Addrs struct {
	GRPC string
	HTTP string
}

// Start builds the binary at pkgDir and starts it on loopback ports with the
// given extra args and env, waiting for its "serving" line.
func Start(t testing.TB, pkgDir string, args []string, env ...string) (*proctest.Process, Addrs) {
	t.Helper()
	bin := proctest.Build(t, pkgDir)
	all := append([]string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0"}, args...)
	p := proctest.Start(t, bin, all, env...)
	line := p.WaitLog(t, 60*time.Second, proctest.Msg("serving"))
	a := Addrs{GRPC: str(line["grpc"]), HTTP: str(line["http"])}
	if a.GRPC == "" || a.HTTP == "" {
		t.Fatalf("serving line lacks addresses: %v", line)
	}
	return p, a
}

func str(v any) string {
	s, _ := v.(string)
	return s
}

// AssertLifecycle starts the binary at pkgDir, checks gRPC health, /metrics,
// /healthz and /readyz, then sends SIGTERM and expects exit code 0 after a
// "stopped" log line.
func AssertLifecycle(t *testing.T, pkgDir, serviceName string, args []string, env ...string) {
	t.Helper()
	p, addrs := Start(t, pkgDir, args, env...)

	serving := p.WaitLog(t, time.Second, proctest.Msg("serving"))
	if serving["service"] != serviceName {
		t.Errorf("log line service = %v, want %q", serving["service"], serviceName)
	}
	if serving["level"] != "INFO" {
		t.Errorf("log line level = %v, want INFO", serving["level"])
	}

	conn, err := grpc.NewClient(addrs.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatalf("grpc.health.v1 Check: %v", err)
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health status = %v, want SERVING", resp.GetStatus())
	}

	metrics := get(t, "http://"+addrs.HTTP+"/metrics", http.StatusOK)
	for _, want := range []string{"go_goroutines", "process_start_time_seconds", "grpc_server_handled_total"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	get(t, "http://"+addrs.HTTP+"/healthz", http.StatusOK)
	get(t, "http://"+addrs.HTTP+"/readyz", http.StatusOK)

	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, 30*time.Second); code != 0 {
		t.Fatalf("exit code after SIGTERM = %d, want 0:\n%s", code, p.Output())
	}
	p.WaitLog(t, time.Second, proctest.Msg("stopped"))
}

func get(t *testing.T, url string, want int) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("GET %s = %d, want %d: %s", url, resp.StatusCode, want, b)
	}
	return string(b)
}

// BadInput is one malformed REST request and the answer it must get.
type BadInput struct {
	Name         string
	Method, Path string
	Body         string
	// Status is the HTTP status wanted; Statuses, when set, the statuses
	// accepted instead (for a limit another layer may enforce first).
	Status   int
	Statuses []int
	// Field, when set, must be named by a google.rpc.BadRequest field
	// violation and in the message.
	Field string
}

// CheckBadInput sends each request to base (http://host:port) with the
// bearer token and checks the answer: the wanted status, and the suite's
// one error shape, a google.rpc.Status JSON whose BadRequest names Field.
func CheckBadInput(t *testing.T, base, token string, cases []BadInput) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.Name, func(t *testing.T) {
			req, err := http.NewRequest(tc.Method, base+tc.Path, strings.NewReader(tc.Body))
			if err != nil {
				t.Fatal(err)
			}
			if token != "" {
				req.Header.Set("Authorization", "Bearer "+token)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			wanted := tc.Statuses
			if len(wanted) == 0 {
				wanted = []int{tc.Status}
			}
			if !slices.Contains(wanted, resp.StatusCode) {
				t.Fatalf("%s %s = %d %.300s; want %v", tc.Method, tc.Path, resp.StatusCode, raw, wanted)
			}
			var st struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
				Details []struct {
					Type            string `json:"@type"`
					FieldViolations []struct {
						Field       string `json:"field"`
						Description string `json:"description"`
					} `json:"fieldViolations"`
				} `json:"details"`
			}
			// A streaming call writes the status as {"error": ...}, its line
			// format.
			var line struct {
				Error json.RawMessage `json:"error"`
			}
			if json.Unmarshal(raw, &line) == nil && len(line.Error) > 0 {
				raw = line.Error
			}
			if err := json.Unmarshal(raw, &st); err != nil || st.Code == 0 || st.Message == "" {
				t.Fatalf("the answer is not a google.rpc.Status JSON: %.300s (%v)", raw, err)
			}
			if tc.Field == "" {
				return
			}
			named := false
			for _, d := range st.Details {
				for _, fv := range d.FieldViolations {
					named = named || (d.Type == "type.googleapis.com/google.rpc.BadRequest" && fv.Field == tc.Field && fv.Description != "")
				}
			}
			if !named || !strings.Contains(st.Message, tc.Field) {
				t.Errorf("the answer does not name %s in a BadRequest and its message: %.500s", tc.Field, raw)
			}
		})
	}
}

// NoErrorLogs fails when p logged at ERROR level: bad input is the
// client's fault and must not page anyone.
func NoErrorLogs(t *testing.T, p *proctest.Process) {
	t.Helper()
	for _, l := range p.Logs() {
		if l["level"] == "ERROR" {
			t.Errorf("logged an ERROR: %v", l)
		}
	}
}

// Unchanged reads query (one row, one text column summing up what clients
// can write) from the database at dsn now, and returns the check to run
// after the bad input: it fails, naming what, when the answer changed.
func Unchanged(t *testing.T, dsn, what, query string) (check func()) {
	t.Helper()
	ctx := context.Background()
	pool, err := postgres.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	read := func() string {
		t.Helper()
		var s string
		if err := pool.QueryRow(ctx, query).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := read()
	return func() {
		t.Helper()
		if after := read(); after != before {
			t.Errorf("bad input changed %s:\n before %s\n after  %s", what, before, after)
		}
	}
}
