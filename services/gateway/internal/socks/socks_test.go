package socks

import (
	"bufio"
	"bytes"
	"testing"

	"github.com/egress-proxies/egress-proxies/services/gateway/internal/tunnel"
)

func TestReadRequest(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		in     []byte
		target string
		code   byte
	}{
		{"ipv4", []byte{5, 1, 0, 1, 127, 0, 0, 1, 0x01, 0xbb}, "127.0.0.1:443", tunnel.SocksOK},
		{"domain", append(append([]byte{5, 1, 0, 3, 11}, "example.com"...), 0, 80), "example.com:80", tunnel.SocksOK},
		{"ipv6", append(append([]byte{5, 1, 0, 4}, bytes.Repeat([]byte{0}, 15)...), 1, 0x1f, 0x90), "[::1]:8080", tunnel.SocksOK},
		{"bind", []byte{5, 2, 0, 1, 127, 0, 0, 1, 0, 80}, "", tunnel.SocksCmdUnsupported},
		{"udp associate", []byte{5, 3, 0, 1, 127, 0, 0, 1, 0, 80}, "", tunnel.SocksCmdUnsupported},
		{"unknown address type", []byte{5, 1, 0, 9, 0, 0}, "", tunnel.SocksAddrUnsupport},
		{"empty domain", []byte{5, 1, 0, 3, 0, 0, 80}, "", tunnel.SocksFailure},
		{"version 4", []byte{4, 1, 0, 1, 127, 0, 0, 1, 0, 80}, "", tunnel.SocksFailure},
		{"truncated", []byte{5, 1, 0, 1, 127}, "", tunnel.SocksFailure},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			target, code := readRequest(bufio.NewReader(bytes.NewReader(c.in)))
			if target != c.target || code != c.code {
				t.Fatalf("readRequest = %q, %#x; want %q, %#x", target, code, c.target, c.code)
			}
		})
	}
}

func FuzzReadRequest(f *testing.F) {
	f.Add([]byte{5, 1, 0, 1, 127, 0, 0, 1, 0x01, 0xbb})
	f.Add(append(append([]byte{5, 1, 0, 3, 11}, "example.com"...), 0, 80))
	f.Fuzz(func(t *testing.T, in []byte) {
		target, code := readRequest(bufio.NewReader(bytes.NewReader(in)))
		if (code == tunnel.SocksOK) != (target != "") {
			t.Fatalf("readRequest(%x) = %q, %#x", in, target, code)
		}
	})
}
