package egress

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"testing/iotest"
)

// netTimeout is a net.Error that timed out, as a dial or read deadline
// reports it.
type netTimeout struct{}

func (netTimeout) Error() string   { return "i/o timeout" }
func (netTimeout) Timeout() bool   { return true }
func (netTimeout) Temporary() bool { return true }

func TestDefaultClassifier(t *testing.T) {
	t.Parallel()
	html := http.Header{"Content-Type": {"text/html; charset=utf-8"}}
	long := strings.Repeat("x", CaptchaPeekBytes) + "captcha"
	cases := []struct {
		name    string
		status  int
		header  http.Header
		body    string
		err     error
		want    Outcome
		wantRaw string // the body the caller still reads; default body
	}{
		{name: "200 page", status: 200, header: html, body: "<h1>catalog</h1>", want: Success},
		{name: "404 is the target's answer, not a ban", status: 404, header: html, body: "not here", want: Success},
		{name: "403", status: 403, body: "forbidden", want: Blocked},
		{name: "429", status: 429, body: "slow down", want: Banned},
		{name: "captcha page", status: 200, header: html, body: `<form id="g-reCAPTCHA">`, want: Captcha},
		{name: "captcha word past the peek window", status: 200, header: html, body: long, want: Success},
		{name: "captcha in JSON is data", status: 200, header: http.Header{"Content-Type": {"application/json"}}, body: `{"captcha":1}`, want: Success},
		{name: "challenge header", status: 503, header: http.Header{"Cf-Mitigated": {"challenge"}}, want: Captcha},
		{name: "timeout", err: &netTimeout{}, want: Timeout},
		{name: "deadline", err: context.DeadlineExceeded, want: Timeout},
		{name: "refused", err: &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}, want: Error},
		{name: "caller cancelled", err: context.Canceled, want: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var resp *http.Response
			if tc.err == nil {
				h := tc.header
				if h == nil {
					h = http.Header{}
				}
				resp = &http.Response{StatusCode: tc.status, Header: h, Body: io.NopCloser(strings.NewReader(tc.body))}
			}
			v := DefaultClassifier.Classify(nil, resp, tc.err)
			if v.Outcome != tc.want {
				t.Fatalf("outcome = %v, want %v", v.Outcome, tc.want)
			}
			if v.Ban() != (tc.want > Success) {
				t.Errorf("Ban() = %v for %v", v.Ban(), v.Outcome)
			}
			if resp != nil {
				b, err := io.ReadAll(resp.Body)
				if err != nil || string(b) != tc.body {
					t.Errorf("body after classifying = %q, %v; want it intact", b, err)
				}
			}
		})
	}
}

// A read error met while peeking reaches the caller, not a short body.
func TestCaptchaPeekKeepsReadError(t *testing.T) {
	t.Parallel()
	boom := errors.New("connection reset")
	resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/html"}},
		Body: io.NopCloser(io.MultiReader(strings.NewReader("<p>partial"), iotest.ErrReader(boom)))}
	if v := DefaultClassifier.Classify(nil, resp, nil); v.Outcome != Success {
		t.Fatalf("outcome = %v", v.Outcome)
	}
	b, err := io.ReadAll(resp.Body)
	if string(b) != "<p>partial" || !errors.Is(err, boom) {
		t.Fatalf("read %q, %v; want the partial body then %v", b, err, boom)
	}
}

// Whatever an HTML body holds, classifying it leaves the caller the very
// same bytes.
func FuzzClassifyKeepsBody(f *testing.F) {
	f.Add([]byte("<h1>catalog</h1>"), "text/html")
	f.Add([]byte(strings.Repeat("a", CaptchaPeekBytes-3)+"CAPTCHA"), "text/html; charset=utf-8")
	f.Add([]byte{}, "application/xhtml+xml")
	f.Add([]byte("captcha"), "text/html; charset")
	f.Fuzz(func(t *testing.T, body []byte, contentType string) {
		resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {contentType}},
			Body: io.NopCloser(bytes.NewReader(body))}
		v := DefaultClassifier.Classify(nil, resp, nil)
		got, err := io.ReadAll(resp.Body)
		if err != nil || !bytes.Equal(got, body) {
			t.Fatalf("body after classifying: %d bytes, %v; want the %d bytes intact", len(got), err, len(body))
		}
		if v.Outcome != Success && v.Outcome != Captcha {
			t.Fatalf("a 200 classified %v", v.Outcome)
		}
	})
}
