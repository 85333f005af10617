package bus

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v5"
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
		}
	}
}

// errConsumerStopped is a consume function that returned on its own.
var errConsumerStopped = errors.New("the consumer stopped")

// KeepConsuming runs consume until ctx ends, and runs it again (as Retry
// does) whenever it returns before that. consume sets up a consumer and
// follows it; setting it up fails while NATS or JetStream is unreachable,
// and the service sees none of its messages until an attempt succeeds.
func KeepConsuming(ctx context.Context, log *slog.Logger, what string, consume func(context.Context) error) {
	_ = Retry(ctx, log, "consuming "+what, func(ctx context.Context) error {
		if err := consume(ctx); err != nil {
			return err
		}
		return errConsumerStopped
	})
}
