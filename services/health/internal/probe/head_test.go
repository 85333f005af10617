package probe

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http"
	"net/textproto"
	"strings"
	"testing"
	"testing/iotest"
)

func TestReadHead(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		in        string
		whole     bool
		wantCode  int
		wantText  string
		wantExtra bool
		wantErr   string
	}{
		{name: "CONNECT established", in: "HTTP/1.1 200 Connection established\r\n\r\n", whole: true, wantCode: 200, wantText: "200 Connection established"},
		{name: "headers", in: "HTTP/1.0 200 OK\r\nVia: 1.1 squid\r\nX-Empty:\r\n\r\n", whole: true, wantCode: 200, wantText: "200 OK"},
		{name: "bare LF", in: "HTTP/1.1 200 OK\nVia: x\n\n", whole: true, wantCode: 200, wantText: "200 OK"},
		{name: "no reason", in: "HTTP/1.1 200\r\n\r\n", whole: true, wantCode: 200, wantText: "200"},
		{name: "data after the head", in: "HTTP/1.1 200 OK\r\n\r\n\x16\x03\x01", whole: true, wantCode: 200, wantText: "200 OK", wantExtra: true},
		{name: "refusal needs only its status line", in: "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic", whole: true, wantCode: 407, wantText: "407 Proxy Authentication Required"},
		{name: "status line only", in: "HTTP/1.1 503 Service Unavailable\r\nthe rest is never read", wantCode: 503, wantText: "503 Service Unavailable"},
		{name: "extra spaces before the code", in: "HTTP/1.1   200 OK\r\n\r\n", whole: true, wantCode: 200, wantText: "200 OK"},
		{name: "not HTTP", in: "SSH-2.0-OpenSSH_9.6\r\n", whole: true, wantErr: "malformed"},
		{name: "bad version", in: "HTTP/1.10 200 OK\r\n\r\n", whole: true, wantErr: "malformed HTTP version"},
		{name: "short code", in: "HTTP/1.1 20 OK\r\n\r\n", whole: true, wantErr: "malformed HTTP status code"},
		{name: "signed code", in: "HTTP/1.1 +20 OK\r\n\r\n", whole: true, wantErr: "malformed HTTP status code"},
		{name: "four digits", in: "HTTP/1.1 2000 OK\r\n\r\n", whole: true, wantErr: "malformed HTTP status code"},
		{name: "header without a colon", in: "HTTP/1.1 200 OK\r\nnonsense\r\n\r\n", whole: true, wantErr: "malformed header line"},
		{name: "header name not a token", in: "HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n", whole: true, wantErr: "malformed header line"},
		{name: "control character in a value", in: "HTTP/1.1 200 OK\r\nVia: a\x00b\r\n\r\n", whole: true, wantErr: "malformed header line"},
		{name: "cut short", in: "HTTP/1.1 200 OK\r\nVia: x\r\n", whole: true, wantErr: io.ErrUnexpectedEOF.Error()},
		{name: "empty", in: "", whole: true, wantErr: io.ErrUnexpectedEOF.Error()},
		{name: "endless headers", in: "HTTP/1.1 200 OK\r\n" + strings.Repeat("X-Pad: 0123456789\r\n", 300) + "\r\n", whole: true, wantErr: "response head over"},
		{name: "endless status line", in: "HTTP/1.1 200 " + strings.Repeat("x", 5000), wantErr: "response head over"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			// Whole, and a byte at a time: reads may split anywhere.
			for _, r := range []io.Reader{strings.NewReader(tc.in), iotest.OneByteReader(strings.NewReader(tc.in))} {
				h, err := readHead(r, make([]byte, headMax), tc.whole)
				if tc.wantErr != "" {
					if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
						t.Fatalf("readHead = %+v, %v; want an error with %q", h, err, tc.wantErr)
					}
					continue
				}
				if err != nil || h.code != tc.wantCode || string(h.status) != tc.wantText {
					t.Fatalf("readHead = %d %q, %v; want %d %q", h.code, h.status, err, tc.wantCode, tc.wantText)
				}
				if _, split := r.(*strings.Reader); split && h.extra != tc.wantExtra {
					t.Errorf("extra = %v, want %v", h.extra, tc.wantExtra)
				}
			}
		})
	}
}

// A head that stops at its blank line leaves what follows unread: the TLS
// client reads it next.
func TestReadHead_readsNoFurther(t *testing.T) {
	t.Parallel()
	r := iotest.OneByteReader(strings.NewReader("HTTP/1.1 200 OK\r\n\r\nTLS"))
	if _, err := readHead(r, make([]byte, headMax), true); err != nil {
		t.Fatal(err)
	}
	rest, _ := io.ReadAll(r)
	if string(rest) != "TLS" {
		t.Errorf("left %q unread, want %q", rest, "TLS")
	}
}

// FuzzReadHead checks the hand-written reader against net/http: a status
// it reads, net/http reads the same from that status line; a whole head it
// accepts has headers net/textproto accepts; split reads change nothing.
func FuzzReadHead(f *testing.F) {
	for _, seed := range []string{
		"HTTP/1.1 200 Connection established\r\n\r\n",
		"HTTP/1.0 200 OK\r\nVia: 1.1 squid\r\n\r\n",
		"HTTP/1.1 403 Forbidden\r\nContent-Length: 3\r\n\r\nno!",
		"HTTP/1.1 200 OK\nA:\n\n",
		"HTTP/9.9 999 x\r\n\r\n",
		"HTTP/1.1 200 OK\r\n b: c\r\n\r\n",
		"\x16\x03\x01\x00\x05hello",
	} {
		f.Add([]byte(seed), true)
	}
	f.Fuzz(func(t *testing.T, in []byte, whole bool) {
		h, err := readHead(bytes.NewReader(in), make([]byte, headMax), whole)
		h1, err1 := readHead(iotest.OneByteReader(bytes.NewReader(in)), make([]byte, headMax), whole)
		if (err == nil) != (err1 == nil) || h.code != h1.code || !bytes.Equal(h.status, h1.status) {
			t.Fatalf("split reads: %d %q %v; whole reads: %d %q %v", h1.code, h1.status, err1, h.code, h.status, err)
		}
		if err != nil {
			return
		}
		line, _, _ := bytes.Cut(in, []byte{'\n'})
		resp, herr := http.ReadResponse(bufio.NewReader(bytes.NewReader(append(bytes.Clone(line), "\n\n"...))), nil)
		if herr != nil || resp.StatusCode != h.code {
			t.Fatalf("status line %q: ours %d, net/http %v %v", line, h.code, resp, herr)
		}
		if whole && h.code == 200 {
			i := bytes.Index(in, []byte("\n\r\n"))
			if j := bytes.Index(in, []byte("\n\n")); i < 0 || (j >= 0 && j < i) {
				i = j
			}
			hdrs := in[len(line)+1 : i+1]
			if _, err := textproto.NewReader(bufio.NewReader(bytes.NewReader(append(bytes.Clone(hdrs), "\r\n"...)))).ReadMIMEHeader(); err != nil && !errors.Is(err, io.EOF) {
				t.Fatalf("accepted headers %q that net/textproto refuses: %v", hdrs, err)
			}
		}
	})
}
