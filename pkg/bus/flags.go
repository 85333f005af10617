package bus

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// Flags are the NATS flags of every service (each also EGRESS_<NAME>):
// one place, so every binary spells, defaults and checks them the same
// way.
type Flags struct {
	// URL is the NATS server (or a comma-separated seed list of a
	// cluster). It has no default: Connect never fails on an unreachable
	// server, so a service left on a guessed address would only warn,
	// forever.
	URL string
	// Prefix names every subject and stream (Names); the same on every
	// service of one installation.
	Prefix string
	// StreamReplicas is how many JetStream servers store each stream.
	StreamReplicas int
}

// DefaultFlags are the flags' defaults.
func DefaultFlags() Flags { return Flags{Prefix: DefaultPrefix, StreamReplicas: 1} }

// Register adds --nats-url, --nats-prefix and --nats-stream-replicas to
// fs, with f's current values as defaults (DefaultFlags when f is zero).
func (f *Flags) Register(fs *flag.FlagSet) {
	if *f == (Flags{}) {
		*f = DefaultFlags()
	}
	fs.StringVar(&f.URL, "nats-url", f.URL, "NATS URL, JetStream enabled (nats://host:4222; a cluster's servers separated by commas); required")
	fs.StringVar(&f.Prefix, "nats-prefix", f.Prefix, "prefix of every NATS subject and stream; the same on every service")
	fs.IntVar(&f.StreamReplicas, "nats-stream-replicas", f.StreamReplicas,
		"JetStream servers that store each stream (3 on a three-server cluster); the same on every service")
}

// Validate checks the flags, naming the one that is wrong.
func (f *Flags) Validate() error {
	switch {
	case f.URL == "":
		return errors.New("--nats-url is required")
	case f.StreamReplicas < 1 || f.StreamReplicas > MaxStreamReplicas:
		return fmt.Errorf("--nats-stream-replicas must be between 1 and %d, got %d", MaxStreamReplicas, f.StreamReplicas)
	}
	return nil
}

// Names are the stream, subject and consumer names of the prefix.
func (f *Flags) Names() Names { return Names{Prefix: f.Prefix} }

// Connect validates the flags and connects as Connect does; name
// identifies the connection on the server.
func (f *Flags) Connect(ctx context.Context, name string, log *slog.Logger, metrics prometheus.Registerer) (*nats.Conn, jetstream.JetStream, error) {
	if err := f.Validate(); err != nil {
		return nil, nil, err
	}
	return Connect(ctx, ConnectOptions{URL: f.URL, Name: name, Names: f.Names(), StreamReplicas: f.StreamReplicas, Log: log, Metrics: metrics})
}
