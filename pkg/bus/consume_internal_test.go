package bus

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
)

// The waits between attempts double up to the most, and start over after
// an attempt that ran longer than that; read from the logged retry_in.
func TestKeepConsumingSpacesAttempts(t *testing.T) {
	first, most := retryFirst, retryMost
	retryFirst, retryMost = 5*time.Millisecond, 20*time.Millisecond
	t.Cleanup(func() { retryFirst, retryMost = first, most })

	var out logtest.Buffer
	log := slog.New(slog.NewJSONHandler(&out, nil))
	ctx, cancel := context.WithCancel(t.Context())
	attempts := 0
	_ = retry(ctx, log, "consuming test events", nil, func(ctx context.Context) error {
		attempts++
		switch attempts {
		case 5:
			time.Sleep(30 * time.Millisecond) // ran for longer than the most
		case 7:
			cancel()
			<-ctx.Done()
			return nil
		}
		return errors.New("nats: no responders available for request")
	})
	if attempts != 7 {
		t.Fatalf("attempts = %d, want 7 (it returns once ctx ends)", attempts)
	}
	var waits []string
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var rec struct {
			Msg     string `json:"msg"`
			Error   string `json:"error"`
			RetryIn int64  `json:"retry_in"`
		}
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec.Msg != "WARNING: consuming test events failed; retrying" || rec.Error == "" {
			t.Errorf("log line %q: want the WARNING naming what failed, with the error", line)
		}
		waits = append(waits, time.Duration(rec.RetryIn).String())
	}
	want := []string{"5ms", "10ms", "20ms", "20ms", "5ms", "10ms"}
	if strings.Join(waits, " ") != strings.Join(want, " ") {
		t.Errorf("waits = %v, want %v", waits, want)
	}
}

// Retry stops at the first success and reports no error.
func TestRetryStopsAtSuccess(t *testing.T) {
	first, most := retryFirst, retryMost
	retryFirst, retryMost = time.Millisecond, time.Millisecond
	t.Cleanup(func() { retryFirst, retryMost = first, most })
	attempts := 0
	err := Retry(t.Context(), slog.New(slog.DiscardHandler), "test setup", func(context.Context) error {
		if attempts++; attempts < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	if err != nil || attempts != 3 {
		t.Errorf("Retry = %v after %d attempts, want nil after 3", err, attempts)
	}
}

// While NATS is down the waits grow; when it comes back the consumer is
// set up again at once, not after the wait in progress.
func TestKeepConsumingTriesAgainOnceNATSReturns(t *testing.T) {
	first, most := retryFirst, retryMost
	retryFirst, retryMost = time.Hour, time.Hour
	t.Cleanup(func() { retryFirst, retryMost = first, most })

	srv := natstest.New(t)
	names := Names{}
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := EnsureStreams(t.Context(), js, names); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	failed := make(chan struct{}, 1)
	set := make(chan struct{})
	go KeepConsuming(ctx, js, slog.New(slog.DiscardHandler), "test results", func(ctx context.Context) error {
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		if _, err := js.CreateOrUpdateConsumer(cctx, names.ResultStream(), jetstream.ConsumerConfig{Durable: "wake"}); err != nil {
			select {
			case failed <- struct{}{}:
			default:
			}
			return err
		}
		close(set)
		<-ctx.Done()
		return nil
	})
	select {
	case <-failed: // now waiting an hour
	case <-time.After(10 * time.Second):
		t.Fatal("setting up the consumer did not fail while NATS was down")
	}
	srv.Start(t)
	select {
	case <-set:
	case <-time.After(20 * time.Second):
		t.Fatal("the consumer was not set up again within 20s of NATS coming back")
	}
}
