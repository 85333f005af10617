package kvm

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

var testHost = Host{Name: "h1", Address: "h1:22"}

func newTestPool(d *fakeDialer, perHost int) *hostPool {
	return newHostPool(d.dial, perHost, slog.New(slog.DiscardHandler), nil)
}

func TestPoolReusesAndRedials(t *testing.T) {
	t.Parallel()
	d := &fakeDialer{api: newFakeAPI()}
	p := newTestPool(d, 4)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			_ = p.call(context.Background(), testHost, func(api libvirtAPI) error { _, err := api.ConnectGetHostname(); return err })
		})
	}
	wg.Wait()
	if d.dialCount() != 1 {
		t.Fatalf("dials = %d, want 1 shared by concurrent callers", d.dialCount())
	}
	// The link dies (keepalive, peer gone): the next call redials.
	d.conns[0].closedByPeer()
	if err := p.call(context.Background(), testHost, func(libvirtAPI) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if d.dialCount() != 2 {
		t.Errorf("dials = %d, want a redial after the connection died", d.dialCount())
	}
}

func (c *fakeConn) closedByPeer() { c.once.Do(func() { close(c.done) }) }

func TestPoolDropsOnlyOnTransportErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		err     error
		dropped bool
	}{
		{"transport error", io.ErrUnexpectedEOF, true},
		{"libvirt error", lvErr(libvirt.ErrNoDomain, "x"), false},
		{"classified verdict", errclass.New(errclass.Permanent, "bad placement"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d := &fakeDialer{api: newFakeAPI()}
			p := newTestPool(d, 4)
			_ = p.call(context.Background(), testHost, func(libvirtAPI) error { return tc.err })
			_ = p.call(context.Background(), testHost, func(libvirtAPI) error { return nil })
			if got := d.dialCount() == 2; got != tc.dropped {
				t.Errorf("dials = %d; dropped = %v, want %v", d.dialCount(), got, tc.dropped)
			}
		})
	}
}

// go-libvirt RPCs take no context: a call whose context ends while the RPC
// blocks returns at once, closing the connection to unblock it.
func TestPoolCallAbandonsABlockedRPCByClosing(t *testing.T) {
	t.Parallel()
	api := newFakeAPI()
	release := make(chan struct{})
	api.block["ConnectGetHostname"] = release
	d := &fakeDialer{api: api}
	p := newTestPool(d, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := p.call(ctx, testHost, func(api libvirtAPI) error { _, err := api.ConnectGetHostname(); return err })
	close(release)
	if !errors.Is(err, context.DeadlineExceeded) || d.closedCount() != 1 {
		t.Fatalf("err = %v, closed = %d; want the deadline and the connection closed", err, d.closedCount())
	}
}

// The probe gives up on a slow RPC but keeps the shared connection; until
// the abandoned one returns, further probes are refused at once.
func TestProbeAbandonsWithoutClosing(t *testing.T) {
	t.Parallel()
	api := newFakeAPI()
	release := make(chan struct{})
	api.block["ConnectGetLibVersion"] = release
	d := &fakeDialer{api: api}
	p := newTestPool(d, 4)
	probe := func(timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		return p.probe(ctx, testHost, func(api libvirtAPI) error { _, err := api.ConnectGetLibVersion(); return err })
	}
	if err := probe(50 * time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("probe = %v, want the deadline", err)
	}
	if d.closedCount() != 0 {
		t.Fatal("the probe closed the shared connection")
	}
	if err := probe(time.Second); !errors.Is(err, errProbeBusy) {
		t.Fatalf("second probe = %v, want errProbeBusy", err)
	}
	// Operations keep using the connection meanwhile.
	if err := p.call(context.Background(), testHost, func(api libvirtAPI) error { _, err := api.ConnectGetHostname(); return err }); err != nil {
		t.Fatal(err)
	}
	delete(api.block, "ConnectGetLibVersion")
	close(release)
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := probe(time.Second)
		if err == nil {
			break
		}
		if !errors.Is(err, errProbeBusy) || time.Now().After(deadline) {
			t.Fatalf("probe after the RPC returned = %v", err)
		}
		time.Sleep(5 * time.Millisecond) // the abandoned RPC is finishing
	}
	if d.dialCount() != 1 {
		t.Errorf("dials = %d, want the one connection throughout", d.dialCount())
	}
}

// At most maxConcurrentPerHost operations run against a host; a caller
// waiting for a slot gives up with its context.
func TestPoolBoundsOperationsPerHost(t *testing.T) {
	t.Parallel()
	d := &fakeDialer{api: newFakeAPI()}
	p := newTestPool(d, 2)
	release := make(chan struct{})
	var running sync.WaitGroup
	running.Add(2)
	var done sync.WaitGroup
	for range 2 {
		done.Go(func() {
			_ = p.call(context.Background(), testHost, func(libvirtAPI) error { running.Done(); <-release; return nil })
		})
	}
	running.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	ran := false
	err := p.call(ctx, testHost, func(libvirtAPI) error { ran = true; return nil })
	if !errors.Is(err, context.DeadlineExceeded) || ran {
		t.Fatalf("third call = %v (ran %v), want it to wait and give up", err, ran)
	}
	// Another host is not held up.
	if err := p.call(context.Background(), Host{Name: "h2"}, func(libvirtAPI) error { return nil }); err != nil {
		t.Fatal(err)
	}
	close(release)
	done.Wait()
	if err := p.call(context.Background(), testHost, func(libvirtAPI) error { return nil }); err != nil {
		t.Fatal(err)
	}
}

// Waiting for a host's connection ends with the caller's context even while
// another caller is dialling it.
func TestPoolWaitForDialEndsWithContext(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	started := make(chan struct{})
	dial := func(ctx context.Context, h Host) (*hostClient, error) {
		close(started)
		<-release
		return nil, errors.New("host down")
	}
	p := newHostPool(dial, 4, slog.New(slog.DiscardHandler), nil)
	go func() { _ = p.call(context.Background(), testHost, func(libvirtAPI) error { return nil }) }()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := p.probe(ctx, testHost, func(libvirtAPI) error { return nil })
	close(release)
	if !errors.Is(err, context.DeadlineExceeded) || checkReason(err) != provisioner.ReasonTimeout {
		t.Fatalf("probe = %v (%s), want a timeout", err, checkReason(err))
	}
}
