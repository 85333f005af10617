package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// postChunked streams size bytes of one JSON string to POST /v1/proxies
// and returns the status of the answer; the sender stops when the server
// closes the connection.
func postChunked(t *testing.T, addr, token string, size int64) int {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Minute))
	head := "POST /v1/proxies HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
	if token != "" {
		head += "Authorization: Bearer " + token + "\r\n"
	}
	if _, err := io.WriteString(conn, head+"\r\n"); err != nil {
		t.Fatal(err)
	}
	sent := make(chan int64, 1)
	go func() {
		first := []byte(`{"name":"` + strings.Repeat("a", 64<<10-9))
		rest := []byte(strings.Repeat("a", 64<<10))
		n := int64(0)
		for chunk := first; n < size; chunk = rest {
			if _, err := fmt.Fprintf(conn, "%x\r\n%s\r\n", len(chunk), chunk); err != nil {
				break
			}
			n += int64(len(chunk))
		}
		sent <- n
	}()
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	resp.Body.Close()
	_, _ = io.Copy(io.Discard, br) // until the server closes
	_ = conn.Close()
	t.Logf("token %q: %d after sending %d MiB", token, resp.StatusCode, <-sent>>20)
	return resp.StatusCode
}

// A 300 MB request body, without a token and with one, against the real
// binary: answered 401 and 413, with the process's peak memory unmoved
// (before the REST guard, the orchestrator went from 32 MB to 1.7 GB).
func TestHugeBodiesKeepMemoryFlat(t *testing.T) {
	t.Parallel()
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("ops tok-ops admin\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p, addrs := servicetest.Start(t, ".", []string{
		"--auth-token-file=" + tokens, "--providers-config=" + providersFile(t),
		"--database-url=" + orchtest.Database(t), "--nats-url=" + natstest.New(t).URL(),
	})
	before := proctest.StatusBytes(t, p.PID(), "VmHWM")
	if code := postChunked(t, addrs.HTTP, "", 300<<20); code != http.StatusUnauthorized {
		t.Errorf("300 MB without a token = %d, want 401", code)
	}
	if code := postChunked(t, addrs.HTTP, "tok-ops", 300<<20); code != http.StatusRequestEntityTooLarge {
		t.Errorf("300 MB with a token = %d, want 413", code)
	}
	after := proctest.StatusBytes(t, p.PID(), "VmHWM")
	t.Logf("peak RSS %d MiB before, %d MiB after", before>>20, after>>20)
	if grew := after - before; grew > 32<<20 {
		t.Errorf("peak RSS grew by %d MiB (from %d MiB), want at most 32 MiB", grew>>20, before>>20)
	}
}
