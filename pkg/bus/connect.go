package bus

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Connect connects a service to NATS as name and makes sure the streams
// exist. NATS being unreachable does not fail it: the connection keeps
// trying in the background (forever, as after any later disconnect), the
// streams are ensured once it is up, and meanwhile the service serves
// what needs no NATS, its consumers waiting under KeepConsuming. Only
// what no retry can mend is an error: a malformed URL. The connection
// lives until the caller closes it; the background work until ctx ends.
func Connect(ctx context.Context, url, name string, names Names, log *slog.Logger) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(url, nats.Name(name), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("WARNING: disconnected from NATS; reconnecting", "error", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) { log.Info("reconnected to NATS", "server", c.ConnectedUrlRedacted()) }),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to NATS: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	ensure := func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return EnsureStreams(ctx, js, names)
	}
	err = nats.ErrNoServers
	if nc.IsConnected() {
		if err = ensure(ctx); err == nil {
			return nc, js, nil
		}
	}
	log.Warn("WARNING: NATS JetStream is unreachable; starting without it, its consumers wait for it", "error", err)
	go func() { _ = Retry(ctx, log, "ensuring the NATS streams", ensure) }()
	return nc, js, nil
}
