package gcp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
)

// wire is the HTTP transport under the Compute client. It adds what the
// SDK cannot send and logs the traffic:
//
//   - returnPartialSuccess=true on aggregated instance lists: the v1.75
//     request type has no field for it, and without it one unreachable
//     zone fails the whole list;
//   - one DEBUG line per request (method, path, status, duration), and
//     with payloads on the bodies too, the user-data metadata value
//     replaced by its length.
type wire struct {
	base     http.RoundTripper
	log      *slog.Logger
	payloads bool
}

func (w *wire) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodGet && strings.HasSuffix(req.URL.Path, "/aggregated/instances") {
		q := req.URL.Query()
		if q.Get("returnPartialSuccess") == "" {
			q.Set("returnPartialSuccess", "true")
			r2 := req.Clone(req.Context())
			r2.URL.RawQuery = q.Encode()
			req = r2
		}
	}
	ctx := req.Context()
	debug := w.log.Enabled(ctx, slog.LevelDebug)
	var reqBody []byte
	if debug && w.payloads && req.Body != nil && req.GetBody != nil {
		if rc, err := req.GetBody(); err == nil {
			reqBody, _ = io.ReadAll(rc)
			_ = rc.Close()
		}
	}
	start := time.Now()
	resp, err := w.base.RoundTrip(req)
	if !debug {
		return resp, err
	}
	attrs := []any{"method", req.Method, "path", req.URL.Path, "query", req.URL.RawQuery, "duration", time.Since(start)}
	if err != nil {
		w.log.DebugContext(ctx, "gcp api call", append(attrs, "error", err.Error())...)
		return resp, err
	}
	attrs = append(attrs, "status", resp.StatusCode)
	if w.payloads {
		body, rerr := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(body))
		if rerr != nil {
			resp.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body), errReader{rerr}))
		}
		if reqBody != nil {
			attrs = append(attrs, "requestBody", redactedBody(reqBody))
		}
		attrs = append(attrs, "responseBody", redactedBody(body))
	}
	w.log.DebugContext(ctx, "gcp api call", attrs...)
	return resp, nil
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// redactedBody renders a JSON body for the log with every user-data
// metadata value replaced; a body that is not JSON is shown by length only.
func redactedBody(body []byte) string {
	if len(body) == 0 {
		return ""
	}
	var v any
	if err := json.Unmarshal(body, &v); err != nil {
		return fmt.Sprintf("[%d bytes, not JSON]", len(body))
	}
	redact(v)
	out, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("[%d bytes]", len(body))
	}
	return string(out)
}

// secretMetadata are the metadata keys whose values are secret.
var secretMetadata = map[string]bool{"user-data": true, nocloud.MetaKeyProxyUser: true, nocloud.MetaKeyProxyPassword: true}

// redact replaces the value of every {"key":K,"value":…} item of a secret
// metadata key K (user-data, the proxy's credentials), wherever it sits
// (an insert body, an instance, a list page).
func redact(v any) {
	switch t := v.(type) {
	case map[string]any:
		if k, _ := t["key"].(string); secretMetadata[k] {
			if s, ok := t["value"].(string); ok {
				t["value"] = fmt.Sprintf("[redacted %d bytes]", len(s))
			}
		}
		for _, x := range t {
			redact(x)
		}
	case []any:
		for _, x := range t {
			redact(x)
		}
	}
}
