package probe

import (
	"bytes"
	"fmt"
	"io"
)

// headMax bounds the head of a response the probe reads: the CONNECT
// answer's status line and headers, or the target's status line. Proxies
// answer CONNECT in a few dozen bytes; anything longer is not a proxy
// worth passing.
const headMax = 4096

// head is what the probe needs from a response head.
type head struct {
	code int
	// status is the status line after the protocol ("200 OK"); it points
	// into the read buffer.
	status []byte
	// extra is set when bytes followed the head in the same read: for a
	// CONNECT answer, data the proxy sent before the tunnel carried
	// anything.
	extra bool
}

// readHead reads a response head from r into buf: only the status line
// when whole is false, through the blank line that ends the headers when
// whole is true and the status is 200. It reads no further than it needs,
// so what follows stays for the TLS client.
//
// The status line is parsed as net/http parses it (HTTP/d.d, a three-digit
// code); header lines are not interpreted — the probe needs none of them —
// but each must be a "name: value" line. It is hand-written because
// net/http's ReadResponse was a tenth of a probe's CPU (maps, a Response,
// a textproto reader per call); FuzzReadHead checks it against net/http.
func readHead(r io.Reader, buf []byte, whole bool) (head, error) {
	n := 0
	var h head
	lineEnd := -1
	for {
		if n == len(buf) {
			return h, fmt.Errorf("response head over %d bytes", len(buf))
		}
		m, err := r.Read(buf[n:])
		n += m
		if lineEnd < 0 {
			if i := bytes.IndexByte(buf[:n], '\n'); i >= 0 {
				lineEnd = i
				var perr error
				if h, perr = parseStatusLine(buf[:i]); perr != nil {
					return h, perr
				}
				if !whole || h.code != 200 {
					return h, nil
				}
			}
		}
		if lineEnd >= 0 {
			if end, ok, err := headersEnd(buf[lineEnd+1 : n]); err != nil {
				return h, err
			} else if ok {
				h.extra = lineEnd+1+end < n
				return h, nil
			}
		}
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return h, err
		}
	}
}

// parseStatusLine reads "HTTP/d.d SP ddd [SP reason]" (a trailing CR
// allowed), as net/http does.
func parseStatusLine(line []byte) (head, error) {
	line = bytes.TrimSuffix(line, []byte{'\r'})
	proto, status, ok := bytes.Cut(line, []byte{' '})
	if !ok {
		return head{}, fmt.Errorf("malformed HTTP response %q", line)
	}
	if len(proto) != len("HTTP/1.1") || !bytes.HasPrefix(proto, []byte("HTTP/")) || !digit(proto[5]) || proto[6] != '.' || !digit(proto[7]) {
		return head{}, fmt.Errorf("malformed HTTP version %q", proto)
	}
	status = bytes.TrimLeft(status, " ")
	if len(status) < 3 || !digit(status[0]) || !digit(status[1]) || !digit(status[2]) || (len(status) > 3 && status[3] != ' ') {
		return head{}, fmt.Errorf("malformed HTTP status code %q", status)
	}
	code := int(status[0]-'0')*100 + int(status[1]-'0')*10 + int(status[2]-'0')
	return head{code: code, status: status}, nil
}

func digit(b byte) bool { return b >= '0' && b <= '9' }

// headersEnd looks in b (what follows the status line) for the blank line
// that ends the headers: ok with end just past it, ok false when more is
// needed. A complete line that is not "name: value" is an error.
func headersEnd(b []byte) (end int, ok bool, err error) {
	for {
		i := bytes.IndexByte(b[end:], '\n')
		if i < 0 {
			return 0, false, nil
		}
		line := bytes.TrimSuffix(b[end:end+i], []byte{'\r'})
		end += i + 1
		if len(line) == 0 {
			return end, true, nil
		}
		if !headerLine(line) {
			return 0, false, fmt.Errorf("malformed header line %q", line)
		}
	}
}

// headerLine says whether line is "name: value" with a token for name and
// no control character in value, the lines net/textproto accepts (less
// its obsolete continuation lines).
func headerLine(line []byte) bool {
	name, value, ok := bytes.Cut(line, []byte{':'})
	if !ok || len(name) == 0 {
		return false
	}
	for _, c := range name {
		if c >= 0x80 || !tchar[c] {
			return false
		}
	}
	for _, c := range value {
		if (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// tchar holds the bytes of an HTTP token (RFC 9110, section 5.6.2).
var tchar = func() (t [0x80]bool) {
	for _, c := range []byte("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") {
		t[c] = true
	}
	return t
}()
