package kvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"

	"golang.org/x/crypto/ssh"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// neighbourCommand prints the host's IPv4 neighbour table as JSON
// (iproute2 4.15 or later). It is the last source of a guest's address,
// after the guest agent and libvirt's own ARP source: it needs nothing in
// the guest but traffic, and it works where libvirt cannot read the table
// (libvirt 9.0 on recent kernels answers "wrong nlmsg len").
const neighbourCommand = "ip -j -4 neigh show"

// maxCommandOutput bounds what a host command may return; a neighbour
// table of a few thousand entries is far below it.
const maxCommandOutput = 4 << 20

// commandRunner runs a command on a host over the connection's SSH link
// and returns its standard output. Errors are raw (SSH's own); the caller
// classifies them.
type commandRunner func(ctx context.Context, cmd string) ([]byte, error)

// sshRunner runs commands in sessions of client. A session ends with ctx:
// closing it makes Run return, and ctx's error is returned.
func sshRunner(client *ssh.Client) commandRunner {
	return func(ctx context.Context, cmd string) ([]byte, error) {
		s, err := client.NewSession()
		if err != nil {
			return nil, &commandError{cmd: cmd, err: fmt.Errorf("opening an SSH session: %w", err)}
		}
		defer func() { _ = s.Close() }()
		out := &cappedBuffer{limit: maxCommandOutput}
		stderr := &cappedBuffer{limit: 512}
		s.Stdout, s.Stderr = out, stderr
		stop := context.AfterFunc(ctx, func() { _ = s.Close() })
		defer stop()
		err = s.Run(cmd)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if err != nil {
			return nil, &commandError{cmd: cmd, err: err, stderr: strings.TrimSpace(stderr.String())}
		}
		if out.overflow {
			return nil, &commandError{cmd: cmd, err: fmt.Errorf("%w (more than %d bytes)", errOutputTooLong, maxCommandOutput)}
		}
		return out.Bytes(), nil
	}
}

// errOutputTooLong is a command whose output passed maxCommandOutput.
var errOutputTooLong = errors.New("output too long")

// commandError is a host command that did not run to a successful end.
type commandError struct {
	cmd    string
	err    error
	stderr string
}

func (e *commandError) Error() string {
	if e.stderr != "" {
		return fmt.Sprintf("%q on the host: %v: %s", e.cmd, e.err, e.stderr)
	}
	return fmt.Sprintf("%q on the host: %v", e.cmd, e.err)
}

func (e *commandError) Unwrap() error { return e.err }

// cappedBuffer keeps the first limit bytes written to it.
type cappedBuffer struct {
	bytes.Buffer
	limit    int
	overflow bool
}

func (b *cappedBuffer) Write(p []byte) (int, error) {
	if room := b.limit - b.Len(); len(p) > room {
		b.overflow = true
		if room > 0 {
			b.Buffer.Write(p[:room])
		}
		return len(p), nil
	}
	return b.Buffer.Write(p)
}

// neighbour is one entry of `ip -j neigh show`.
type neighbour struct {
	Dst    string   `json:"dst"`
	Dev    string   `json:"dev"`
	LLAddr string   `json:"lladdr"`
	State  []string `json:"state"`
}

// hostNeighbours reads host's IPv4 neighbour table through run. Its errors
// are classified here, once:
//
//   - the command ran and failed (no `ip`, an iproute2 without -j, an
//     account whose shell refuses commands) or printed something that is
//     not the table → Permanent: the same command fails the same way until
//     the host changes;
//   - the SSH server refused the session → Permanent when it says it is
//     prohibited, Transient otherwise (too many sessions, a full host);
//   - the link broke, or the command ended without an exit status →
//     Transient;
//   - ctx ending is returned as it is.
func hostNeighbours(ctx context.Context, host string, run commandRunner) ([]neighbour, error) {
	if run == nil {
		return nil, errclass.New(errclass.Permanent, "host %s: this connection cannot run commands", host)
	}
	out, err := run(ctx, neighbourCommand)
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil, err
		}
		return nil, errclass.Wrap(neighbourErrorClass(err), fmt.Errorf("host %s: reading the neighbour table: %w", host, err))
	}
	var ns []neighbour
	if err := json.Unmarshal(out, &ns); err != nil {
		return nil, errclass.Wrap(errclass.Permanent, fmt.Errorf("host %s: %q printed no neighbour table (%d bytes): %w", host, neighbourCommand, len(out), err))
	}
	return ns, nil
}

func neighbourErrorClass(err error) errclass.Class {
	var exit *ssh.ExitError
	var open *ssh.OpenChannelError
	switch {
	case errors.As(err, &exit):
		return errclass.Permanent
	case errors.As(err, &open):
		if open.Reason == ssh.Prohibited {
			return errclass.Permanent
		}
		return errclass.Transient
	case errors.Is(err, errOutputTooLong):
		return errclass.Permanent
	default:
		return errclass.Transient
	}
}

// neighbourAddress is the global IPv4 address the table holds for one of
// macs. An entry the kernel confirmed recently (REACHABLE, DELAY, PROBE,
// PERMANENT) wins over a STALE one, which is still the last address the
// MAC was seen with; FAILED and INCOMPLETE entries are never used.
func neighbourAddress(ns []neighbour, macs []string) string {
	best, bestRank := "", 0
	for _, n := range ns {
		if !macIn(n.LLAddr, macs) {
			continue
		}
		ip := net.ParseIP(n.Dst)
		if ip == nil || ip.To4() == nil || ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() {
			continue
		}
		if r := neighbourRank(n.State); r > bestRank {
			best, bestRank = ip.String(), r
		}
	}
	return best
}

func macIn(mac string, macs []string) bool {
	for _, m := range macs {
		if equalFoldMAC(mac, m) {
			return true
		}
	}
	return false
}

// neighbourRank orders entries by how much they can be trusted; 0 is
// unusable.
func neighbourRank(states []string) int {
	rank := 0
	for _, s := range states {
		switch strings.ToUpper(s) {
		case "FAILED", "INCOMPLETE":
			return 0
		case "REACHABLE", "DELAY", "PROBE", "PERMANENT", "NOARP":
			rank = max(rank, 2)
		case "STALE":
			rank = max(rank, 1)
		}
	}
	return rank
}
