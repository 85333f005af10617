package proxy

import (
	"errors"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// timeouts counts the connections net/http drops for being too slow, which
// it does without an answer: a client over --read-header-timeout before its
// request's headers are complete (one that stalls mid-headers, the
// slowloris pattern, or sends nothing at all) as limit "read_header_timeout",
// and a keep-alive connection over --client-idle-timeout between requests
// as "client_idle". net/http reads under a deadline only then (besides
// stopping its own background read with a deadline already past), so a
// read that fails on its deadline tells which, by the connection's state.
type timeouts struct {
	refusals *prometheus.CounterVec
}

// listen wraps lis so that its connections are watched; connState must be
// srv.ConnState.
func (w *timeouts) listen(lis net.Listener) net.Listener {
	return &watchedListener{Listener: lis, w: w}
}

func (w *timeouts) connState(c net.Conn, st http.ConnState) {
	if wc, ok := c.(*watchedConn); ok {
		wc.state.Store(int32(st))
	}
}

type watchedListener struct {
	net.Listener
	w *timeouts
}

func (l *watchedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &watchedConn{Conn: c, w: l.w}, nil
}

type watchedConn struct {
	net.Conn
	w       *timeouts
	state   atomic.Int32 // an http.ConnState
	counted atomic.Bool
	// aborting: the last read deadline was already past when set, which is
	// how net/http stops its own background read, not a timeout.
	aborting atomic.Bool
}

func (c *watchedConn) SetReadDeadline(t time.Time) error {
	c.aborting.Store(!t.IsZero() && t.Before(time.Now()))
	return c.Conn.SetReadDeadline(t)
}

func (c *watchedConn) SetDeadline(t time.Time) error {
	c.aborting.Store(!t.IsZero() && t.Before(time.Now()))
	return c.Conn.SetDeadline(t)
}

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) && !c.aborting.Load() && !c.counted.Load() {
		switch http.ConnState(c.state.Load()) {
		case http.StateNew, http.StateActive:
			c.counted.Store(true)
			c.w.refusals.WithLabelValues("read_header_timeout").Inc()
		case http.StateIdle:
			c.counted.Store(true)
			c.w.refusals.WithLabelValues("client_idle").Inc()
		}
	}
	return n, err
}

// unwrap is the connection under a watched one: a tunnel relays on it
// directly (the kernel copies TCP to TCP only between the real sockets).
func unwrap(c net.Conn) net.Conn {
	if wc, ok := c.(*watchedConn); ok {
		return wc.Conn
	}
	return c
}
