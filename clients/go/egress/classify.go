package egress

import (
	"bytes"
	"context"
	"errors"
	"io"
	"mime"
	"net"
	"net/http"
	"time"
)

// Verdict is a classifier's judgement of one answer through a proxy.
type Verdict struct {
	// Outcome to report; 0 reports nothing (the caller gave up), Success
	// keeps the proxy.
	Outcome Outcome
	// Cooldown, when positive, replaces the outcome's default length.
	Cooldown time.Duration
	// Scope replaces the outcome's default scope unless ScopeDefault.
	Scope Scope
}

// Ban reports whether the verdict moves the crawler off the proxy.
func (v Verdict) Ban() bool { return v.Outcome > Success }

func (v Verdict) options() []ReportOption {
	var opts []ReportOption
	if v.Cooldown > 0 {
		opts = append(opts, WithCooldown(v.Cooldown))
	}
	if v.Scope != ScopeDefault {
		opts = append(opts, WithScope(v.Scope))
	}
	return opts
}

// Classifier judges what a target answered through a proxy: resp and err
// as the transport returned them. It may read resp.Body if it puts an
// equivalent body back.
type Classifier interface {
	Classify(req *http.Request, resp *http.Response, err error) Verdict
}

// ClassifierFunc adapts a function to Classifier.
type ClassifierFunc func(req *http.Request, resp *http.Response, err error) Verdict

// Classify calls f.
func (f ClassifierFunc) Classify(req *http.Request, resp *http.Response, err error) Verdict {
	return f(req, resp, err)
}

// CaptchaPeekBytes is how much of an HTML answer DefaultClassifier reads
// looking for a captcha.
const CaptchaPeekBytes = 16 << 10

// DefaultClassifier is the RoundTripper's classifier unless told otherwise:
//
//   - 403 Forbidden: Blocked (default cooldown 5m, for the target);
//   - 429 Too Many Requests: Banned (1h, for the target);
//   - a challenge page (header cf-mitigated: challenge, or "captcha" in
//     the first CaptchaPeekBytes of an HTML body): Captcha (10m, for the
//     target);
//   - a timeout: Timeout (1m, every target: the proxy is slow, not
//     banned);
//   - any other transport error (proxy refused, tunnel failed): Error
//     (30s, every target);
//   - a request the caller cancelled: nothing;
//   - anything else: Success.
//
// Wrap it to add a site's own signs of a ban (see ClassifierFunc).
var DefaultClassifier Classifier = ClassifierFunc(classifyDefault)

func classifyDefault(req *http.Request, resp *http.Response, err error) Verdict {
	if err != nil {
		var ne net.Error
		switch {
		case errors.Is(err, context.Canceled):
			return Verdict{}
		case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
			return Verdict{Outcome: Timeout}
		}
		return Verdict{Outcome: Error}
	}
	switch {
	case resp.StatusCode == http.StatusForbidden:
		return Verdict{Outcome: Blocked}
	case resp.StatusCode == http.StatusTooManyRequests:
		return Verdict{Outcome: Banned}
	case resp.Header.Get("Cf-Mitigated") == "challenge", looksLikeCaptcha(resp):
		return Verdict{Outcome: Captcha}
	}
	return Verdict{Outcome: Success}
}

// looksLikeCaptcha peeks at an HTML body and puts what it read back.
func looksLikeCaptcha(resp *http.Response) bool {
	if resp.Body == nil || resp.Body == http.NoBody {
		return false
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mt != "text/html" && mt != "application/xhtml+xml" {
		return false
	}
	head, err := io.ReadAll(io.LimitReader(resp.Body, CaptchaPeekBytes))
	resp.Body = readCloser{io.MultiReader(bytes.NewReader(head), errReader{err}, resp.Body), resp.Body}
	return bytes.Contains(bytes.ToLower(head), []byte("captcha"))
}

type readCloser struct {
	io.Reader
	io.Closer
}

// errReader replays a read error met while peeking, then steps aside.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	return 0, io.EOF
}
