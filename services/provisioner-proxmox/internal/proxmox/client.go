package proxmox

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"mime/multipart"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// LevelTrace is the most detailed level: request parameters,
// config summaries, the agent's addresses (never secrets).
const LevelTrace = slog.LevelDebug - 4

// APIError is an answer other than 2xx. Message is Proxmox's own text
// (the reason phrase, or the body's message); Errors are 400's field
// errors.
type APIError struct {
	Method, Path string
	Status       int
	Message      string
	Errors       map[string]string
}

func (e *APIError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s: %d %s", e.Method, e.Path, e.Status, e.Message)
	if len(e.Errors) > 0 {
		keys := make([]string, 0, len(e.Errors))
		for k := range e.Errors {
			keys = append(keys, k)
		}
		sortStrings(keys)
		for _, k := range keys {
			fmt.Fprintf(&b, "; %s: %s", k, strings.TrimSpace(e.Errors[k]))
		}
	}
	return b.String()
}

// client talks to the API: one shared HTTP/1.1 client, the token read on
// every request, the CA loaded on first use and cached.
type client struct {
	base      string // https://host:8006/api2/json
	tokenFile string
	caFile    string
	insecure  bool
	budgets   Budgets
	log       *slog.Logger
	tp        trace.TracerProvider // nil: the global one

	mu   sync.Mutex
	http *http.Client // built once the CA is loaded
}

var tokenRE = regexp.MustCompile(`^[^@\s=!]+@[^@\s=!]+![^@\s=!]+=\S+$`)

// token reads the token file: the whole "<user>@<realm>!<tokenid>=<secret>"
// line. A missing file is Transient (the Secret has not landed yet), a
// malformed one Permanent. The error never carries the content.
func (c *client) token() (string, error) {
	b, err := os.ReadFile(c.tokenFile)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission) {
			return "", &errclass.Error{Class: errclass.Transient, Message: fmt.Sprintf("token file %s is not readable: %v", c.tokenFile, pathErrReason(err)), Err: errCredentials}
		}
		return "", &errclass.Error{Class: errclass.Transient, Message: fmt.Sprintf("token file %s: %v", c.tokenFile, pathErrReason(err)), Err: errCredentials}
	}
	tok := strings.TrimSpace(string(b))
	if !tokenRE.MatchString(tok) {
		return "", &errclass.Error{Class: errclass.Permanent, Message: fmt.Sprintf("token file %s does not hold one line <user>@<realm>!<tokenid>=<secret>", c.tokenFile), Err: errCredentials}
	}
	return tok, nil
}

// tokenID is the part of the token before "=": never the secret.
func tokenID(tok string) string {
	id, _, _ := strings.Cut(tok, "=")
	return id
}

var errCredentials = errors.New("credentials unavailable")
var errCA = errors.New("CA unusable")

func pathErrReason(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

// httpClient returns the shared client, loading the CA on first use.
func (c *client) httpClient() (*http.Client, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.http != nil {
		return c.http, nil
	}
	tlsCfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: c.insecure} //nolint:gosec // opt-in, logged as a WARNING
	if c.caFile != "" && !c.insecure {
		pemBytes, err := os.ReadFile(c.caFile)
		if err != nil {
			return nil, &errclass.Error{Class: errclass.Transient, Message: fmt.Sprintf("CA file %s is not readable: %v", c.caFile, pathErrReason(err)), Err: errCA}
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pemBytes) {
			return nil, &errclass.Error{Class: errclass.Permanent, Message: fmt.Sprintf("CA file %s holds no PEM certificate", c.caFile), Err: errCA}
		}
		tlsCfg.RootCAs = pool
	}
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: c.budgets.Connect, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: c.budgets.TLSHandshake,
		TLSClientConfig:     tlsCfg,
		ForceAttemptHTTP2:   false,
		TLSNextProto:        map[string]func(string, *tls.Conn) http.RoundTripper{}, // pveproxy speaks HTTP/1.1 only
		MaxIdleConns:        16,
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     90 * time.Second,
	}
	var otelOpts []otelhttp.Option
	if c.tp != nil {
		otelOpts = append(otelOpts, otelhttp.WithTracerProvider(c.tp))
	}
	c.http = &http.Client{Transport: parentGated{plain: tr, traced: otelhttp.NewTransport(tr, otelOpts...)}}
	return c.http, nil
}

// parentGated traces a request only inside a traced operation.
type parentGated struct{ plain, traced http.RoundTripper }

func (p parentGated) CloseIdleConnections() {
	if c, ok := p.plain.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (p parentGated) RoundTrip(r *http.Request) (*http.Response, error) {
	if trace.SpanContextFromContext(r.Context()).IsValid() {
		return p.traced.RoundTrip(r)
	}
	return p.plain.RoundTrip(r)
}

// call describes one request for the api call log line.
type call struct {
	name   string // the seam method: Clone, Config, ...
	method string
	path   string // below /api2/json, already escaped
	form   url.Values
	attrs  []any // identifiers: node, vmid, storage, ...
	trace  []any // V(2) parameters
}

// do runs one request and decodes {"data": ...} into out (when not nil).
func (c *client) do(ctx context.Context, cl call, out any) error {
	start := time.Now()
	status, err := c.roundTrip(ctx, cl, nil, "", out)
	c.logCall(ctx, cl, start, status, err, out)
	return err
}

func (c *client) roundTrip(ctx context.Context, cl call, body []byte, contentType string, out any) (int, error) {
	tok, err := c.token()
	if err != nil {
		return 0, err
	}
	hc, err := c.httpClient()
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.budgets.Request)
	defer cancel()
	u := c.base + cl.path
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	} else if len(cl.form) > 0 {
		if cl.method == http.MethodGet || cl.method == http.MethodDelete {
			u += "?" + cl.form.Encode()
		} else {
			enc := cl.form.Encode()
			rd = strings.NewReader(enc)
			contentType = "application/x-www-form-urlencoded"
		}
	}
	req, err := http.NewRequestWithContext(ctx, cl.method, u, rd)
	if err != nil {
		return 0, errclass.Wrap(errclass.Permanent, err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	req.Header.Set("Authorization", "PVEAPIToken="+tok)
	req.Header.Set("Accept", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return 0, &transportError{op: cl.method + " " + cl.path, err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return resp.StatusCode, &transportError{op: cl.method + " " + cl.path, err: err}
	}
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, apiErrorFrom(cl, resp, b)
	}
	if out == nil {
		return resp.StatusCode, nil
	}
	var env struct {
		Data json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(b, &env); err != nil {
		return resp.StatusCode, errclass.New(errclass.Transient, "%s %s: undecodable answer: %v", cl.method, cl.path, err)
	}
	if len(env.Data) == 0 || string(env.Data) == "null" {
		return resp.StatusCode, nil
	}
	dec := json.NewDecoder(bytes.NewReader(env.Data))
	dec.UseNumber()
	if err := dec.Decode(out); err != nil {
		return resp.StatusCode, errclass.New(errclass.Transient, "%s %s: undecodable data: %v", cl.method, cl.path, err)
	}
	return resp.StatusCode, nil
}

func apiErrorFrom(cl call, resp *http.Response, body []byte) *APIError {
	e := &APIError{Method: cl.method, Path: cl.path, Status: resp.StatusCode}
	// The reason phrase is Proxmox's message.
	if _, reason, ok := strings.Cut(resp.Status, " "); ok {
		e.Message = strings.TrimSpace(reason)
	}
	var env struct {
		Message string            `json:"message"`
		Errors  map[string]string `json:"errors"`
	}
	if json.Unmarshal(body, &env) == nil {
		if m := strings.TrimSpace(env.Message); m != "" && (e.Message == "" || e.Message == http.StatusText(resp.StatusCode)) {
			e.Message = m
		}
		e.Errors = env.Errors
	}
	if e.Message == "" {
		e.Message = http.StatusText(resp.StatusCode)
	}
	return e
}

// transportError is a failure below HTTP: dial, TLS, a cut connection, a
// timeout.
type transportError struct {
	op  string
	err error
}

func (e *transportError) Error() string { return e.op + ": " + e.err.Error() }
func (e *transportError) Unwrap() error { return e.err }

// upload posts the seed as multipart/form-data with a Content-Length:
// content=iso and the file part named "filename". The body is never
// logged.
func (c *client) upload(ctx context.Context, node, storage, filename string, data []byte) (string, error) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	if err := mw.WriteField("content", "iso"); err != nil {
		return "", err
	}
	h := textproto.MIMEHeader{}
	h.Set("Content-Disposition", fmt.Sprintf(`form-data; name="filename"; filename="%s"`, filename))
	h.Set("Content-Type", "application/octet-stream")
	pw, err := mw.CreatePart(h)
	if err != nil {
		return "", err
	}
	if _, err := pw.Write(data); err != nil {
		return "", err
	}
	if err := mw.Close(); err != nil {
		return "", err
	}
	cl := call{name: "Upload", method: http.MethodPost, path: "/nodes/" + url.PathEscape(node) + "/storage/" + url.PathEscape(storage) + "/upload",
		attrs: []any{"node", node, "storage", storage, "filename", filename}, trace: []any{"bytes", len(data)}}
	start := time.Now()
	var upid string
	status, err := c.roundTrip(ctx, cl, buf.Bytes(), mw.FormDataContentType(), &upid)
	c.logCall(ctx, cl, start, status, err, &upid)
	return upid, err
}

func (c *client) logCall(ctx context.Context, cl call, start time.Time, status int, err error, out any) {
	if !c.log.Enabled(ctx, slog.LevelDebug) {
		return
	}
	attrs := append([]any{"call", cl.name}, cl.attrs...)
	if s, ok := out.(*string); ok && s != nil && strings.HasPrefix(*s, "UPID:") {
		attrs = append(attrs, "upid", *s)
	}
	attrs = append(attrs, "duration", time.Since(start))
	if err != nil {
		if status != 0 {
			attrs = append(attrs, "httpStatus", status)
		}
		attrs = append(attrs, "error", err.Error())
	}
	c.log.DebugContext(ctx, "proxmox api call", attrs...)
	if len(cl.trace) > 0 && c.log.Enabled(ctx, LevelTrace) {
		c.log.Log(ctx, LevelTrace, "proxmox api call", append(append([]any{"call", cl.name}, cl.attrs...), cl.trace...)...)
	}
}

func sortStrings(s []string) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// num reads a JSON number or numeric string.
func num(v any) int64 {
	switch x := v.(type) {
	case json.Number:
		if n, err := x.Int64(); err == nil {
			return n
		}
		f, _ := x.Float64()
		return int64(f)
	case string:
		n, _ := strconv.ParseInt(x, 10, 64)
		return n
	case float64:
		return int64(x)
	case int:
		return int64(x)
	}
	return 0
}

func str(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		return x
	case json.Number:
		return x.String()
	}
	return fmt.Sprint(v)
}

// closeIdle closes idle connections (tests, shutdown).
func (c *client) closeIdle() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.http != nil {
		c.http.CloseIdleConnections()
	}
}
