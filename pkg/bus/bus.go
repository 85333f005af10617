// Package bus is the suite's NATS JetStream layout and plumbing: the stream,
// subject and consumer names every service agrees on, the stream
// configurations, and publish/decode helpers that carry protobuf payloads
// with the W3C trace context in message headers.
//
// Layout, for the default prefix "egress":
//
//	stream EGRESS_COMMANDS       egress.cmd.<provider>      work queue; one durable consumer per provider ("provisioner-<provider>"), shared by that backend's replicas
//	stream EGRESS_RESULTS        egress.result.<provider>   work queue; one durable consumer ("orchestrator"), shared by the orchestrator replicas
//	stream EGRESS_PROXY_EVENTS   egress.proxy.<uid>         the latest ProxyEvent of every proxy (one message per subject), kept 7 days
//	stream EGRESS_HEALTH_EVENTS  egress.health.<uid>        the latest HealthTransitionEvent of every proxy, kept 7 days
//	(no stream)                  egress.leases.changes      LeaseChangesEvents on core NATS, for WatchLeases on every lease replica; not stored
//
// Because the event streams keep the last message of each proxy, a consumer
// that starts with DeliverLastPerSubject reads the current state of every
// proxy and then follows changes.
package bus

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/protobuf/proto"
)

// DefaultPrefix is the subject prefix when none is configured.
const DefaultPrefix = "egress"

// EventRetention is how long the event streams keep a proxy's last event.
const EventRetention = 7 * 24 * time.Hour

// ContentType is the value of the Content-Type header on every message.
const ContentType = "application/x-protobuf"

// Names derives every stream, subject and consumer name from a prefix, so
// several installations (or tests) can share one NATS server.
type Names struct {
	Prefix string
}

func (n Names) prefix() string {
	if n.Prefix == "" {
		return DefaultPrefix
	}
	return n.Prefix
}

func (n Names) stream(kind string) string {
	return strings.ToUpper(strings.NewReplacer(".", "_", "-", "_").Replace(n.prefix())) + "_" + kind
}

// CommandStream holds provisioner commands.
func (n Names) CommandStream() string { return n.stream("COMMANDS") }

// CommandSubject is where commands for provider are published.
func (n Names) CommandSubject(provider string) string { return n.prefix() + ".cmd." + provider }

// ProvisionerConsumer is the durable consumer shared by provider's
// provisioner replicas.
func (n Names) ProvisionerConsumer(provider string) string { return "provisioner-" + provider }

// ResultStream holds command results.
func (n Names) ResultStream() string { return n.stream("RESULTS") }

// ResultSubject is where provider's provisioners publish results.
func (n Names) ResultSubject(provider string) string { return n.prefix() + ".result." + provider }

// ResultSubjects matches every result subject.
func (n Names) ResultSubjects() string { return n.prefix() + ".result.>" }

// OrchestratorConsumer is the durable results consumer shared by the
// orchestrator replicas.
func (n Names) OrchestratorConsumer() string { return "orchestrator" }

// ProxyEventStream holds the latest ProxyEvent of every proxy.
func (n Names) ProxyEventStream() string { return n.stream("PROXY_EVENTS") }

// ProxyEventSubject is the subject of one proxy's events.
func (n Names) ProxyEventSubject(uid string) string { return n.prefix() + ".proxy." + uid }

// ProxyEventSubjects matches every proxy's events.
func (n Names) ProxyEventSubjects() string { return n.prefix() + ".proxy.>" }

// HealthEventStream holds the latest HealthTransitionEvent of every proxy.
func (n Names) HealthEventStream() string { return n.stream("HEALTH_EVENTS") }

// HealthEventSubject is the subject of one proxy's health transitions.
func (n Names) HealthEventSubject(uid string) string { return n.prefix() + ".health." + uid }

// HealthEventSubjects matches every proxy's health transitions.
func (n Names) HealthEventSubjects() string { return n.prefix() + ".health.>" }

// DemandStream holds the latest lease demand of every pool.
func (n Names) DemandStream() string { return n.stream("DEMAND") }

// NoPool is the subject token of the demand of proxies that belong to no
// pool (pool names are DNS labels, so it never names one).
const NoPool = "_none"

// DemandSubject is the subject of one pool's demand; pool "" is NoPool.
func (n Names) DemandSubject(pool string) string {
	if pool == "" {
		pool = NoPool
	}
	return n.prefix() + ".demand." + pool
}

// DemandSubjects matches every pool's demand.
func (n Names) DemandSubjects() string { return n.prefix() + ".demand.>" }

// LeaseChangesSubject is the core NATS subject (no stream stores it) on
// which every lease replica publishes the lease changes it commits, and
// from which every replica feeds its WatchLeases streams.
func (n Names) LeaseChangesSubject() string { return n.prefix() + ".leases.changes" }

// StreamConfigs are the canonical configurations of the suite's streams.
func (n Names) StreamConfigs() []jetstream.StreamConfig {
	return []jetstream.StreamConfig{
		{
			Name:        n.CommandStream(),
			Description: "provisioner commands, one subject per provider",
			Subjects:    []string{n.prefix() + ".cmd.>"},
			Retention:   jetstream.WorkQueuePolicy,
			Storage:     jetstream.FileStorage,
			MaxAge:      24 * time.Hour,
			Duplicates:  2 * time.Minute,
		},
		{
			Name:        n.ResultStream(),
			Description: "provisioner command results",
			Subjects:    []string{n.ResultSubjects()},
			Retention:   jetstream.WorkQueuePolicy,
			Storage:     jetstream.FileStorage,
			MaxAge:      24 * time.Hour,
			Duplicates:  2 * time.Minute,
		},
		{
			Name:              n.ProxyEventStream(),
			Description:       "the latest change of every proxy",
			Subjects:          []string{n.ProxyEventSubjects()},
			Retention:         jetstream.LimitsPolicy,
			Storage:           jetstream.FileStorage,
			MaxMsgsPerSubject: 1,
			MaxAge:            EventRetention,
		},
		{
			Name:              n.HealthEventStream(),
			Description:       "the latest health transition of every proxy",
			Subjects:          []string{n.HealthEventSubjects()},
			Retention:         jetstream.LimitsPolicy,
			Storage:           jetstream.FileStorage,
			MaxMsgsPerSubject: 1,
			MaxAge:            EventRetention,
		},
		{
			Name:              n.DemandStream(),
			Description:       "the latest lease demand of every pool, from the lease service",
			Subjects:          []string{n.DemandSubjects()},
			Retention:         jetstream.LimitsPolicy,
			Storage:           jetstream.MemoryStorage,
			MaxMsgsPerSubject: 1,
			MaxAge:            time.Hour,
		},
	}
}

// MaxStreamReplicas is the largest replica count JetStream accepts.
const MaxStreamReplicas = 5

// StreamOption adjusts the canonical stream configurations to an
// installation.
type StreamOption func(*jetstream.StreamConfig)

// Replicas stores every stream on n servers of a JetStream cluster, so the
// streams survive the loss of a minority of them. Every service of an
// installation must be given the same count: each one updates the streams
// to its own configuration when it connects.
func Replicas(n int) StreamOption {
	return func(c *jetstream.StreamConfig) { c.Replicas = n }
}

// EnsureStreams creates the streams, or updates them to the canonical
// configuration; it is idempotent. Services call it through Connect, at
// start or as soon as NATS answers.
func EnsureStreams(ctx context.Context, js jetstream.JetStream, n Names, opts ...StreamOption) error {
	for _, cfg := range n.StreamConfigs() {
		for _, o := range opts {
			o(&cfg)
		}
		if _, err := js.CreateOrUpdateStream(ctx, cfg); err != nil {
			return fmt.Errorf("stream %s: %w", cfg.Name, err)
		}
	}
	return nil
}

// Message builds a NATS message carrying msg and the trace context of ctx.
func Message(ctx context.Context, subject string, msg proto.Message) (*nats.Msg, error) {
	data, err := proto.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("encoding %T: %w", msg, err)
	}
	return EncodedMessage(ctx, subject, data), nil
}

// EncodedMessage builds a NATS message carrying data, a message already
// encoded as Message encodes it, and the trace context of ctx.
func EncodedMessage(ctx context.Context, subject string, data []byte) *nats.Msg {
	m := nats.NewMsg(subject)
	m.Data = data
	m.Header.Set("Content-Type", ContentType)
	otel.GetTextMapPropagator().Inject(ctx, propagation.HeaderCarrier(http.Header(m.Header)))
	return m
}

// Publish publishes msg on subject through JetStream and waits for the
// stream's acknowledgement. Pass jetstream.WithMsgID to have the stream drop
// duplicates within its window.
func Publish(ctx context.Context, js jetstream.JetStream, subject string, msg proto.Message, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	m, err := Message(ctx, subject, msg)
	if err != nil {
		return nil, err
	}
	return js.PublishMsg(ctx, m, opts...)
}

// WaitAcks waits until the stream acknowledged every asynchronous publish
// of futures (js.PublishMsgAsync), and returns the first failure, naming
// its subject.
func WaitAcks(ctx context.Context, futures []jetstream.PubAckFuture) error {
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return fmt.Errorf("publishing on %s: %w", f.Msg().Subject, err)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// ErrBadPayload marks a message whose payload is not the expected protobuf.
// Such a message can never be processed: terminate it rather than retry.
var ErrBadPayload = errors.New("bad message payload")

// Decode unmarshals a JetStream message into into and returns ctx extended
// with the trace context from its headers.
func Decode(ctx context.Context, m jetstream.Msg, into proto.Message) (context.Context, error) {
	ctx = TraceContext(ctx, m.Headers())
	if err := proto.Unmarshal(m.Data(), into); err != nil {
		return ctx, fmt.Errorf("%w: %s on %s: %v", ErrBadPayload, into.ProtoReflect().Descriptor().FullName(), m.Subject(), err)
	}
	return ctx, nil
}

// TraceContext returns ctx with the trace context carried in h, if any.
func TraceContext(ctx context.Context, h nats.Header) context.Context {
	if h == nil {
		return ctx
	}
	return otel.GetTextMapPropagator().Extract(ctx, propagation.HeaderCarrier(http.Header(h)))
}
