// Package socks is the gateway's SOCKS5 listener (RFC 1928): username and
// password authentication (RFC 1929) only, where the username carries the
// options and the password the client token, and the CONNECT command,
// which becomes a tunnel through a leased proxy. BIND and UDP ASSOCIATE are
// refused as unsupported.
package socks

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/egress-proxies/egress-proxies/services/gateway/internal/access"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/options"
	"github.com/egress-proxies/egress-proxies/services/gateway/internal/tunnel"
)

// Server serves SOCKS5.
type Server struct {
	Core   *tunnel.Core
	Access *access.Checker
	// HandshakeTimeout bounds everything before the tunnel opens (the
	// SOCKS5 counterpart of a read-header timeout).
	HandshakeTimeout time.Duration
	Log              *slog.Logger
}

const (
	version     = 0x05
	authVersion = 0x01
	methodUser  = 0x02
	methodNone  = 0x00
	noMethod    = 0xff
	cmdConnect  = 0x01
	atypIPv4    = 0x01
	atypDomain  = 0x03
	atypIPv6    = 0x04
)

// Serve accepts connections until ctx ends, then closes the listener and
// every open connection.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	var mu sync.Mutex
	conns := map[net.Conn]struct{}{}
	var wg sync.WaitGroup
	go func() {
		<-ctx.Done()
		_ = lis.Close()
		mu.Lock()
		for c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
	}()
	defer wg.Wait()
	for {
		conn, err := lis.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return err
		}
		mu.Lock()
		conns[conn] = struct{}{}
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.handle(ctx, conn)
			mu.Lock()
			delete(conns, conn)
			mu.Unlock()
		}()
	}
}

func (s *Server) handle(ctx context.Context, conn net.Conn) {
	_ = conn.SetDeadline(time.Now().Add(s.HandshakeTimeout))
	hc := &handshakeConn{Conn: conn}
	br := bufio.NewReader(hc)
	caller, ok := s.authenticate(conn, br)
	if !ok {
		s.countTimeout(hc)
		_ = conn.Close()
		return
	}
	target, code := readRequest(br)
	if code != tunnel.SocksOK {
		if s.countTimeout(hc) {
			_ = conn.Close()
			return
		}
		s.count(caller, "bad_request")
		reply(conn, code)
		_ = conn.Close()
		return
	}
	ctx, span := tunnel.StartSpan(ctx, caller, "socks5", target)
	defer span.End()
	t, f := s.Core.Open(ctx, caller, "socks5", target)
	if f != nil {
		s.count(caller, f.Outcome)
		reply(conn, f.Socks)
		_ = conn.Close()
		return
	}
	if err := reply(conn, tunnel.SocksOK); err != nil {
		_ = conn.Close()
		s.Core.Abort(t)
		return
	}
	_ = conn.SetDeadline(time.Time{})
	var buffered []byte
	if n := br.Buffered(); n > 0 {
		buffered, _ = br.Peek(n)
		buffered = append([]byte(nil), buffered...)
	}
	s.Core.Relay(t, conn, buffered)
}

// handshakeConn notes a read that ended on the handshake deadline.
type handshakeConn struct {
	net.Conn
	timedOut bool
}

func (c *handshakeConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		c.timedOut = true
	}
	return n, err
}

// countTimeout counts a handshake that did not finish within
// HandshakeTimeout as limit "socks_handshake_timeout" (a client that
// stalls or sends nothing), and reports whether it was one. The client
// gets no answer: it has not said enough to be given one.
func (s *Server) countTimeout(hc *handshakeConn) bool {
	if !hc.timedOut {
		return false
	}
	s.Core.Metrics.Refusals.WithLabelValues("socks_handshake_timeout").Inc()
	return true
}

func (s *Server) count(c access.Caller, outcome string) {
	s.Core.Metrics.Requests.WithLabelValues(c.ClientID, c.Options.Pool, c.Options.Provider, "socks5", outcome).Inc()
}

// authenticate runs the method negotiation and, for username/password,
// the subnegotiation. A caller that offers no username/password method is
// accepted without credentials only when authentication is off.
func (s *Server) authenticate(conn net.Conn, br *bufio.Reader) (access.Caller, bool) {
	var hdr [2]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil || hdr[0] != version {
		return access.Caller{}, false
	}
	methods := make([]byte, hdr[1])
	if _, err := io.ReadFull(br, methods); err != nil {
		return access.Caller{}, false
	}
	var user, none bool
	for _, m := range methods {
		user = user || m == methodUser
		none = none || m == methodNone
	}
	switch {
	case user:
	case none && s.Access.Disabled():
		if _, err := conn.Write([]byte{version, methodNone}); err != nil {
			return access.Caller{}, false
		}
		caller, err := s.Access.Check(conn.RemoteAddr().String(), "", "", false)
		return caller, err == nil
	default:
		s.Core.Metrics.AuthFailures.WithLabelValues("socks5", string(access.Missing)).Inc()
		_, _ = conn.Write([]byte{version, noMethod})
		return access.Caller{}, false
	}
	if _, err := conn.Write([]byte{version, methodUser}); err != nil {
		return access.Caller{}, false
	}
	var ver [2]byte
	if _, err := io.ReadFull(br, ver[:]); err != nil || ver[0] != authVersion {
		return access.Caller{}, false
	}
	name := make([]byte, ver[1])
	if _, err := io.ReadFull(br, name); err != nil {
		return access.Caller{}, false
	}
	plen, err := br.ReadByte()
	if err != nil {
		return access.Caller{}, false
	}
	pass := make([]byte, plen)
	if _, err := io.ReadFull(br, pass); err != nil {
		return access.Caller{}, false
	}
	caller, err := s.Access.Check(conn.RemoteAddr().String(), string(name), string(pass), true)
	if err != nil {
		reason := "invalid"
		var refused *access.Refused
		var bad *options.Error
		switch {
		case errors.As(err, &bad):
			reason = "bad_option"
			s.Log.Debug("SOCKS5 username refused", "error", bad.Error())
		case errors.As(err, &refused):
			reason = string(refused.Reason)
		}
		s.Core.Metrics.AuthFailures.WithLabelValues("socks5", reason).Inc()
		_, _ = conn.Write([]byte{authVersion, 0x01})
		return access.Caller{}, false
	}
	if _, err := conn.Write([]byte{authVersion, 0x00}); err != nil {
		return access.Caller{}, false
	}
	return caller, true
}

// readRequest reads a request and returns its CONNECT target as host:port,
// or the reply code that refuses it.
func readRequest(br *bufio.Reader) (string, byte) {
	var hdr [4]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil || hdr[0] != version {
		return "", tunnel.SocksFailure
	}
	var host string
	switch hdr[3] {
	case atypIPv4:
		var ip [4]byte
		if _, err := io.ReadFull(br, ip[:]); err != nil {
			return "", tunnel.SocksFailure
		}
		host = net.IP(ip[:]).String()
	case atypIPv6:
		var ip [16]byte
		if _, err := io.ReadFull(br, ip[:]); err != nil {
			return "", tunnel.SocksFailure
		}
		host = net.IP(ip[:]).String()
	case atypDomain:
		n, err := br.ReadByte()
		if err != nil || n == 0 {
			return "", tunnel.SocksFailure
		}
		name := make([]byte, n)
		if _, err := io.ReadFull(br, name); err != nil {
			return "", tunnel.SocksFailure
		}
		host = string(name)
	default:
		return "", tunnel.SocksAddrUnsupport
	}
	var port [2]byte
	if _, err := io.ReadFull(br, port[:]); err != nil {
		return "", tunnel.SocksFailure
	}
	if hdr[1] != cmdConnect {
		return "", tunnel.SocksCmdUnsupported
	}
	return net.JoinHostPort(host, strconv.Itoa(int(binary.BigEndian.Uint16(port[:])))), tunnel.SocksOK
}

// reply answers a request; the bound address is not disclosed (0.0.0.0:0).
func reply(conn net.Conn, code byte) error {
	_, err := conn.Write([]byte{version, code, 0x00, atypIPv4, 0, 0, 0, 0, 0, 0})
	return err
}
