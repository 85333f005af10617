package bus_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
)

// A consumer set up while NATS is down waits for it instead of giving up,
// and then receives what is published.
func TestKeepConsumingWaitsOutNATS(t *testing.T) {
	t.Parallel()
	srv := natstest.New(t)
	names := bus.Names{}
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := bus.EnsureStreams(t.Context(), js, names); err != nil {
		t.Fatal(err)
	}
	srv.Stop()

	var out logtest.Buffer
	ctx, cancel := context.WithCancel(t.Context())
	got := make(chan string, 1)
	returned := make(chan struct{})
	go func() {
		defer close(returned)
		bus.KeepConsuming(ctx, slog.New(slog.NewTextHandler(&out, nil)), "test results", func(ctx context.Context) error {
			cctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
			defer cancel()
			cons, err := js.CreateOrUpdateConsumer(cctx, names.ResultStream(), jetstream.ConsumerConfig{
				Durable: "keep", AckPolicy: jetstream.AckExplicitPolicy,
			})
			if err != nil {
				return err
			}
			m, err := cons.Next(jetstream.FetchContext(ctx))
			if err != nil {
				return err
			}
			_ = m.Ack()
			got <- m.Subject()
			<-ctx.Done()
			return nil
		})
	}()
	deadline := time.Now().Add(10 * time.Second)
	for !containsWarning(out.String()) {
		if time.Now().After(deadline) {
			t.Fatal("no WARNING logged while NATS was down")
		}
		time.Sleep(20 * time.Millisecond) // polling the log
	}
	srv.Start(t)
	if _, err := js.Publish(t.Context(), names.ResultSubject("pve"), []byte("r")); err != nil {
		t.Fatal(err)
	}
	select {
	case subj := <-got:
		if subj != names.ResultSubject("pve") {
			t.Errorf("received %q", subj)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("nothing consumed after NATS came back; log:\n%s", out.String())
	}
	cancel()
	<-returned
}

func containsWarning(log string) bool {
	return strings.Contains(log, "WARNING: consuming test results failed; retrying")
}

// A service connecting while NATS is down starts anyway; the streams are
// created once NATS is up.
func TestConnectWhileNATSDown(t *testing.T) {
	t.Parallel()
	srv := natstest.New(t)
	url := srv.URL()
	srv.Stop()
	var out logtest.Buffer
	names := bus.Names{}
	nc, js, err := bus.Connect(t.Context(), url, "test", names, slog.New(slog.NewTextHandler(&out, nil)))
	if err != nil {
		t.Fatalf("Connect while NATS is down: %v", err)
	}
	t.Cleanup(nc.Close)
	if !strings.Contains(out.String(), "WARNING: NATS JetStream is unreachable") {
		t.Errorf("no WARNING logged; log:\n%s", out.String())
	}
	srv.Start(t)
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		_, err := js.Stream(ctx, names.ProxyEventStream())
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("streams not created after NATS came back: %v; log:\n%s", err, out.String())
		}
		time.Sleep(50 * time.Millisecond) // polling the server
	}
}

// A malformed URL is the one thing Connect fails on.
func TestConnectRejectsAMalformedURL(t *testing.T) {
	t.Parallel()
	if _, _, err := bus.Connect(t.Context(), "nats://127.0.0.1:notaport", "test", bus.Names{}, slog.New(slog.DiscardHandler)); err == nil {
		t.Error("Connect accepted a malformed URL")
	}
}
