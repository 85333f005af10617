package integration

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// The site never answers /slow, however its request ends. A client that
// gives up mid-request, as http.Transport does when its request's context
// is cancelled, sends TLS close_notify and then closes its socket; the
// close_notify reaches the site first, which ends the request's context
// there. Were the handler to return then, net/http would answer 200 with
// an empty body, and a client still reading in that window gets it
// (http.Transport returns an answer that races the cancel): the "cancelled
// mid-request" crawl of TestReleaseOnEveryExitPath then succeeds. Here the
// window is held open: close_notify sent, the socket kept for reading.
func TestSlowIsNeverAnswered(t *testing.T) {
	t.Parallel()
	st := newSite(t)
	p := startForwardProxy(t, st, net.IPv4(127, 0, 0, 60))
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", p.port), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(20 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(conn, "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT = %v, %v", resp, err)
	}
	if n := br.Buffered(); n != 0 {
		t.Fatalf("%d bytes after the CONNECT answer, before the TLS handshake", n)
	}
	tc := tls.Client(conn, &tls.Config{RootCAs: st.roots, ServerName: "example.com"})
	if _, err := io.WriteString(tc, "GET /slow HTTP/1.1\r\nHost: example.com\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-st.slow:
	case <-time.After(20 * time.Second):
		t.Fatal("/slow never reached the site")
	}
	if err := tc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(tc)
	if len(got) > 0 {
		t.Fatalf("the site answered an abandoned /slow: %q", got)
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the connection was not closed: %v", err)
	}
}
