package bus

import (
	"context"
	"log/slog"
	"time"
)

// Waits between two attempts of KeepConsuming: the first, and the most it
// doubles to. Variables so that this package's tests can shorten them.
var (
	retryFirst = time.Second
	retryMost  = 30 * time.Second
)

// KeepConsuming runs consume until ctx ends, and runs it again whenever it
// returns before that. consume sets up a consumer and follows it; setting
// it up fails while NATS or JetStream is unreachable (a restart, a network
// blip, a replica starting before NATS), and a service should then wait
// for NATS rather than stop. Attempts are spaced a second apart at first,
// doubling to 30s; an attempt that ran longer than that starts the spacing
// over. Each failure is logged as a WARNING naming what, since the service
// sees none of those messages until an attempt succeeds.
func KeepConsuming(ctx context.Context, log *slog.Logger, what string, consume func(context.Context) error) {
	wait := retryFirst
	for {
		started := time.Now()
		err := consume(ctx)
		if ctx.Err() != nil {
			return
		}
		if time.Since(started) > retryMost {
			wait = retryFirst
		}
		log.Warn("WARNING: consuming "+what+" failed; retrying", "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, retryMost)
	}
}
