package bus

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// ConnectOptions say how a service connects to NATS.
type ConnectOptions struct {
	URL string
	// Name identifies the connection on the server (monitoring, logs).
	Name  string
	Names Names
	// StreamReplicas is how many JetStream servers store each stream: 1
	// (the default when 0) on a single server, 3 on a cluster of three.
	StreamReplicas int
	Log            *slog.Logger
	// Metrics, when set, receives egress_nats_connected (1 while connected)
	// and egress_nats_reconnects_total.
	Metrics prometheus.Registerer
}

// Connect connects a service to NATS and makes sure the streams exist.
// NATS being unreachable does not fail it: the connection keeps trying in
// the background (forever, as after any later disconnect), the streams
// are ensured once it is up (and again after each reconnect), and meanwhile the service serves what needs
// no NATS, its consumers waiting under KeepConsuming. Only what no retry
// can mend is an error: a malformed URL or replica count. The connection
// lives until the caller closes it; the background work until ctx ends.
func Connect(ctx context.Context, o ConnectOptions) (*nats.Conn, jetstream.JetStream, error) {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	replicas := o.StreamReplicas
	if replicas == 0 {
		replicas = 1
	}
	if replicas < 1 || replicas > MaxStreamReplicas {
		return nil, nil, fmt.Errorf("NATS stream replicas must be between 1 and %d, got %d", MaxStreamReplicas, o.StreamReplicas)
	}
	nc, err := nats.Connect(o.URL, nats.Name(o.Name), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true),
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
	if o.Metrics != nil {
		if err := registerConnMetrics(o.Metrics, nc); err != nil {
			nc.Close()
			return nil, nil, err
		}
	}
	ensure := func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return EnsureStreams(ctx, js, o.Names, Replicas(replicas))
	}
	err = nats.ErrNoServers
	if nc.IsConnected() {
		err = ensure(ctx)
	}
	ready := err == nil
	if !ready {
		log.Warn("WARNING: NATS JetStream is unreachable; starting without it, its consumers wait for it", "error", err)
	}
	go keepStreams(ctx, log, nc, ready, ensure)
	return nc, js, nil
}

// keepStreams ensures the streams until it has succeeded once (unless
// ready), and again after every reconnect: a NATS server that restarted
// has lost its memory-stored streams, and a new cluster has none.
func keepStreams(ctx context.Context, log *slog.Logger, nc *nats.Conn, ready bool, ensure func(context.Context) error) {
	wake, stop := reconnects(nc)
	defer stop()
	if !ready && retry(ctx, log, "ensuring the NATS streams", wake, ensure) != nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-wake:
			if retry(ctx, log, "ensuring the NATS streams after a reconnect", wake, ensure) != nil {
				return
			}
		}
	}
}

func registerConnMetrics(reg prometheus.Registerer, nc *nats.Conn) error {
	connected := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "egress_nats_connected",
		Help: "1 while the service is connected to NATS, else 0.",
	}, func() float64 {
		if nc.IsConnected() {
			return 1
		}
		return 0
	})
	reconnects := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "egress_nats_reconnects_total",
		Help: "Times the service's NATS connection was established again after it was lost.",
	}, func() float64 { return float64(nc.Stats().Reconnects) })
	for _, c := range []prometheus.Collector{connected, reconnects} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("registering NATS metrics: %w", err)
		}
	}
	return nil
}
