package bus

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Waits between two attempts of Retry: the first, and the most it doubles
// to. Variables so that this package's tests can shorten them.
var (
	retryFirst = time.Second
	retryMost  = 30 * time.Second
)

// Retry calls fn until it succeeds or ctx ends; it returns ctx's error in
// the latter case. It is for what a service needs from NATS that may be
// unreachable for a while (a restart, a network blip, a replica starting
// before NATS): the service waits rather than stops. Attempts are spaced
// a second apart at first, doubling to 30s; an attempt that ran longer
// than that starts the spacing over. Each failure is logged as a WARNING
// naming what failed.
func Retry(ctx context.Context, log *slog.Logger, what string, fn func(context.Context) error) error {
	return retry(ctx, log, what, nil, fn)
}

// retry is Retry that also tries again at once, with the spacing started
// over, whenever wake delivers: NATS has just come back, so waiting out
// the spacing would only delay the service.
func retry(ctx context.Context, log *slog.Logger, what string, wake <-chan nats.Status, fn func(context.Context) error) error {
	retryIn := &backoff.ExponentialBackOff{InitialInterval: retryFirst, Multiplier: 2, MaxInterval: retryMost}
	for {
		started := time.Now()
		err := fn(ctx)
		if err == nil || ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Since(started) > retryMost {
			retryIn.Reset()
		}
		wait := retryIn.NextBackOff()
		log.Warn("WARNING: "+what+" failed; retrying", "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		case <-wake:
			t.Stop()
			retryIn.Reset()
		}
	}
}

// reconnects delivers every time nc connects again, until stop is called.
func reconnects(nc *nats.Conn) (wake <-chan nats.Status, stop func()) {
	ch := nc.StatusChanged(nats.CONNECTED)
	return ch, func() { nc.RemoveStatusListener(ch) }
}

// errConsumerStopped is a consume function that returned on its own.
var errConsumerStopped = errors.New("the consumer stopped")

// KeepConsuming runs consume until ctx ends, and runs it again (as Retry
// does, and at once when js's connection comes back) whenever it returns
// before that. consume sets up a consumer and follows it; setting it up
// fails while NATS or JetStream is unreachable, and the service sees none
// of its messages until an attempt succeeds.
func KeepConsuming(ctx context.Context, js jetstream.JetStream, log *slog.Logger, what string, consume func(context.Context) error) {
	wake, stop := reconnects(js.Conn())
	defer stop()
	_ = retry(ctx, log, "consuming "+what, wake, func(ctx context.Context) error {
		if err := consume(ctx); err != nil {
			return err
		}
		return errConsumerStopped
	})
}

// Liveness of a long-lived pull consumer. Each pull request lasts
// followExpiry and the server sends a heartbeat every followHeartbeat
// while it has nothing to deliver; two missed heartbeats make the client
// library set the consumer up again. A NATS restart can drop the
// notification that would otherwise trigger that, and with the library's
// defaults (30 s requests) such a consumer stays silent for a minute.
const (
	followExpiry    = 10 * time.Second
	followHeartbeat = 2 * time.Second
)

// ConsumeOpts are the options of every long-lived Consume, followed by
// the caller's own.
func ConsumeOpts(opts ...jetstream.PullConsumeOpt) []jetstream.PullConsumeOpt {
	return append([]jetstream.PullConsumeOpt{jetstream.PullExpiry(followExpiry), jetstream.PullHeartbeat(followHeartbeat)}, opts...)
}

// MessagesOpts are ConsumeOpts for a long-lived Messages iterator.
func MessagesOpts() []jetstream.PullMessagesOpt {
	return []jetstream.PullMessagesOpt{jetstream.PullExpiry(followExpiry), jetstream.PullHeartbeat(followHeartbeat)}
}

// UntilReconnect returns a context that ends with ctx or as soon as nc
// connects again after losing its server, for a consumer that should be
// set up afresh after an outage rather than trust the client library to
// resume it: a restarted server can leave a resumed ordered consumer
// silent.
func UntilReconnect(ctx context.Context, nc *nats.Conn) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	wake, stop := reconnects(nc)
	go func() {
		defer stop()
		select {
		case <-ctx.Done():
		case <-wake:
			cancel()
		}
	}()
	return ctx, cancel
}
