package service

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/egress-proxies/egress-proxies/pkg/rest"
)

// guardREST is what stands in front of the REST layer: the bearer token
// is checked before anything of the body is read (an anonymous caller
// cannot make the service read one), and the body is cut off at
// MaxRequestBytes while it is read, answering 413. The REST layer therefore
// never buffers more than the limit, and after a 401 or a 413 the rest of
// the body is not read at all (closeUnread). Roles are checked by the gRPC
// interceptors behind the REST layer, for both transports alike.
func (s *Service) guardREST(mux *runtime.ServeMux) http.Handler {
	limit := int64(s.opts.MaxRequestBytes)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hasBody := r.Body != nil && r.Body != http.NoBody
		if s.authn != nil {
			if _, err := s.authn.Authenticate(r.Header.Get("Authorization")); err != nil {
				if hasBody {
					// Never read the unauthenticated body, not even to
					// keep the connection.
					w.Header().Set("Connection", "close")
				}
				runtime.HTTPError(r.Context(), mux, rest.Marshaler(), w, r, err)
				if hasBody {
					closeUnread(w)
				}
				return
			}
		}
		if r.ContentLength > limit {
			writeTooLarge(w, limit)
			closeUnread(w)
			return
		}
		if !hasBody {
			mux.ServeHTTP(w, r)
			return
		}
		body := &limitedBody{ReadCloser: http.MaxBytesReader(w, r.Body, limit)}
		r.Body = body
		mux.ServeHTTP(&tooLargeWriter{ResponseWriter: w, body: body, limit: limit}, r)
		if body.exceeded.Load() {
			closeUnread(w)
		}
	})
}

// rstAvoidance is how long a connection closeUnread took over stays open,
// its write side shut, before it is closed: as long as net/http waits in
// the same situation, time for the client to read the answer before the
// close resets the connection (unread data in the server's receive buffer
// makes the kernel reset it, which may discard the answer on the client's
// side).
const rstAvoidance = 500 * time.Millisecond

// closeUnread ends the connection after the answer without reading what is
// left of the request body. Left alone, net/http reads (into io.Discard)
// up to 256 KiB of an unread chunked body, or of a declared length up to
// that, after the handler returns, hoping to reuse the connection; and
// http.MaxBytesReader cannot tell net/http that the limit was hit, since w
// is the tracing middleware's wrapper, not net/http's own writer. So the
// answer is flushed, the HTTP/1.x connection taken over (its buffered
// reader holds at most 4 KiB read ahead), its write side shut, and it is
// closed after rstAvoidance, without a read. Under HTTP/2 (not served
// today: the listener offers no ALPN) Hijack fails and nothing is done:
// the stream is reset when the handler returns, and flow control bounds
// what the server buffers.
func closeUnread(w http.ResponseWriter) {
	rc := http.NewResponseController(w)
	if err := rc.Flush(); err != nil {
		return
	}
	conn, _, err := rc.Hijack()
	if err != nil {
		return
	}
	if cw, ok := conn.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	time.AfterFunc(rstAvoidance, func() { _ = conn.Close() })
}

// writeTooLarge answers 413 with the REST layer's error body.
func writeTooLarge(w http.ResponseWriter, limit int64) {
	st := status.New(codes.ResourceExhausted, fmt.Sprintf("the request body exceeds the limit of %d bytes (--max-request-bytes)", limit))
	b, err := rest.Marshaler().Marshal(st.Proto())
	if err != nil {
		b = []byte(`{"code":8,"message":"request body too large"}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	h.Set("Connection", "close")
	w.WriteHeader(http.StatusRequestEntityTooLarge)
	_, _ = w.Write(b)
}

// limitedBody notes when http.MaxBytesReader cut the body off.
type limitedBody struct {
	io.ReadCloser
	exceeded atomic.Bool
}

func (b *limitedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		b.exceeded.Store(true)
	}
	return n, err
}

// tooLargeWriter replaces whatever the REST layer answers to a body cut off by
// the limit (its decoder sees only a read error) with 413.
type tooLargeWriter struct {
	http.ResponseWriter
	body    *limitedBody
	limit   int64
	written bool
	swallow bool
}

func (w *tooLargeWriter) WriteHeader(code int) {
	if w.written {
		return
	}
	w.written = true
	if w.body.exceeded.Load() {
		w.swallow = true
		for k := range w.ResponseWriter.Header() {
			w.ResponseWriter.Header().Del(k)
		}
		writeTooLarge(w.ResponseWriter, w.limit)
		return
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *tooLargeWriter) Write(p []byte) (int, error) {
	if !w.written {
		w.WriteHeader(http.StatusOK)
	}
	if w.swallow {
		return len(p), nil
	}
	return w.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (w *tooLargeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// Flush implements http.Flusher for streamed responses.
func (w *tooLargeWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok && !w.swallow {
		f.Flush()
	}
}
