package bus_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

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
		bus.KeepConsuming(ctx, js, slog.New(slog.NewTextHandler(&out, nil)), "test results", func(ctx context.Context) error {
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
	reg := prometheus.NewRegistry()
	nc, js, err := bus.Connect(t.Context(), bus.ConnectOptions{URL: url, Name: "test", Names: names, Log: slog.New(slog.NewTextHandler(&out, nil)), Metrics: reg})
	if err != nil {
		t.Fatalf("Connect while NATS is down: %v", err)
	}
	t.Cleanup(nc.Close)
	if !strings.Contains(out.String(), "WARNING: NATS JetStream is unreachable") {
		t.Errorf("no WARNING logged; log:\n%s", out.String())
	}
	if got := gauge(t, reg, "egress_nats_connected"); got != 0 {
		t.Errorf("egress_nats_connected = %v while NATS is down, want 0", got)
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
	if got := gauge(t, reg, "egress_nats_connected"); got != 1 {
		t.Errorf("egress_nats_connected = %v once connected, want 1", got)
	}
	srv.Restart(t)
	deadline = time.Now().Add(30 * time.Second)
	for before := gauge(t, reg, "egress_nats_reconnects_total"); gauge(t, reg, "egress_nats_reconnects_total") <= before; {
		if time.Now().After(deadline) {
			t.Fatal("egress_nats_reconnects_total did not count the reconnect after a restart")
		}
		time.Sleep(50 * time.Millisecond) // polling the client
	}
}

// A NATS server that restarts loses its memory-stored streams (pool
// demand); the service creates them again once it has reconnected.
func TestConnectEnsuresStreamsAgainAfterARestart(t *testing.T) {
	t.Parallel()
	srv := natstest.New(t)
	names := bus.Names{}
	nc, js, err := bus.Connect(t.Context(), bus.ConnectOptions{URL: srv.URL(), Name: "test", Names: names, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	srv.Restart(t)
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		_, err := js.Stream(ctx, names.DemandStream())
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the memory-stored demand stream was not created again after the restart: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // polling the server
	}
}

// gauge reads a metric without labels from reg.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			if m.GetGauge() != nil {
				return m.GetGauge().GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// A malformed URL or replica count is all Connect fails on.
func TestConnectRejectsAMalformedURL(t *testing.T) {
	t.Parallel()
	if _, _, err := bus.Connect(t.Context(), bus.ConnectOptions{URL: "nats://127.0.0.1:notaport", Name: "test", Log: slog.New(slog.DiscardHandler)}); err == nil {
		t.Error("Connect accepted a malformed URL")
	}
}

func TestConnectRejectsAReplicaCountJetStreamCannotHave(t *testing.T) {
	t.Parallel()
	url := natstest.New(t).URL()
	for _, n := range []int{-1, bus.MaxStreamReplicas + 1} {
		_, _, err := bus.Connect(t.Context(), bus.ConnectOptions{URL: url, Name: "test", StreamReplicas: n, Log: slog.New(slog.DiscardHandler)})
		if err == nil || !strings.Contains(err.Error(), "stream replicas") {
			t.Errorf("StreamReplicas %d: err = %v, want one naming the stream replicas", n, err)
		}
	}
}
