package provisioner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
)

// Worker executes commands from the provider's shared durable consumer.
// Every replica of one provider runs one on the same consumer, so each
// command goes to one of them; a command whose replica dies unacked is
// redelivered to another after AckWait.
type Worker struct {
	RT    *Runtime
	JS    jetstream.JetStream
	Names bus.Names
	// ReplicaID goes into CommandResult.handled_by.
	ReplicaID string
	// MaxConcurrent bounds the commands executed at once (default 8).
	MaxConcurrent int
	// AckWait is the consumer's ack wait (default 30s). While an operation
	// runs the message is heartbeated every AckWait/3, so only a dead
	// replica lets it expire.
	AckWait time.Duration
	// DrainTimeout is how long in-flight commands may run on after Run's
	// context ends; those still running then are cancelled and handed back
	// with a Nak for another replica (default 10s).
	DrainTimeout time.Duration
	// FetchWait bounds one pull request (default 1s); it is also the
	// longest Run takes to notice its context ended while idle.
	FetchWait time.Duration
	Log       *slog.Logger
	Metrics   *Metrics
}

func (w *Worker) maxConcurrent() int {
	if w.MaxConcurrent > 0 {
		return w.MaxConcurrent
	}
	return 8
}

func (w *Worker) ackWait() time.Duration {
	if w.AckWait > 0 {
		return w.AckWait
	}
	return 30 * time.Second
}

func (w *Worker) heartbeat() time.Duration {
	return max(w.ackWait()/3, 50*time.Millisecond)
}

func (w *Worker) drainTimeout() time.Duration {
	if w.DrainTimeout > 0 {
		return w.DrainTimeout
	}
	return 10 * time.Second
}

func (w *Worker) fetchWait() time.Duration {
	if w.FetchWait > 0 {
		return w.FetchWait
	}
	return time.Second
}

func (w *Worker) log() *slog.Logger {
	if w.Log != nil {
		return w.Log.With("provider", w.RT.Provider(), "replica", w.ReplicaID)
	}
	return slog.New(slog.DiscardHandler)
}

// Consumer creates (or updates) the provider's durable consumer.
func (w *Worker) Consumer(ctx context.Context) (jetstream.Consumer, error) {
	p := w.RT.Provider()
	return w.JS.CreateOrUpdateConsumer(ctx, w.Names.CommandStream(), jetstream.ConsumerConfig{
		Durable:       w.Names.ProvisionerConsumer(p),
		Description:   "commands for the " + p + " provisioner replicas",
		FilterSubject: w.Names.CommandSubject(p),
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       w.ackWait(),
		MaxDeliver:    -1,
		MaxAckPending: 1024,
	})
}

// Run takes commands until ctx ends, then lets in-flight commands finish
// for DrainTimeout, cancels and Naks the rest, and returns. While NATS is
// unreachable at start, it keeps trying to set up its consumer.
func (w *Worker) Run(ctx context.Context) error {
	bus.KeepConsuming(ctx, w.JS, w.log(), "provisioner commands", w.run)
	return nil
}

func (w *Worker) run(ctx context.Context) error {
	log := w.log()
	cons, err := w.Consumer(ctx)
	if err != nil {
		return fmt.Errorf("provisioner consumer: %w", err)
	}
	// Operations outlive ctx by DrainTimeout; abandon cancels them.
	opCtx, abandon := context.WithCancel(context.WithoutCancel(ctx))
	defer abandon()
	slots := make(chan struct{}, w.maxConcurrent())
	var wg sync.WaitGroup
	log.Info("taking provisioner commands", "consumer", w.Names.ProvisionerConsumer(w.RT.Provider()),
		"subject", w.Names.CommandSubject(w.RT.Provider()), "maxConcurrent", w.maxConcurrent(), "ackWait", w.ackWait())
loop:
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			break loop
		}
		msg, err := cons.Next(jetstream.FetchMaxWait(w.fetchWait()))
		if err != nil {
			<-slots
			if ctx.Err() != nil {
				break loop
			}
			if errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, jetstream.ErrNoMessages) {
				continue
			}
			log.Warn("fetching commands failed", "error", err)
			select {
			case <-ctx.Done():
				break loop
			case <-time.After(time.Second):
			}
			continue
		}
		if ctx.Err() != nil {
			// Taken while shutting down: hand it straight back.
			_ = msg.Nak()
			w.Metrics.command(w.RT.Provider(), "requeued")
			<-slots
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			w.handle(opCtx, msg)
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(w.drainTimeout()):
		log.Warn("in-flight commands did not finish in time; handing them back for redelivery", "drainTimeout", w.drainTimeout())
		abandon()
		<-done
	}
	log.Info("stopped taking provisioner commands")
	return nil
}

// handle executes one command. opCtx ends only when the worker abandons
// in-flight work.
func (w *Worker) handle(opCtx context.Context, msg jetstream.Msg) {
	log := w.log()
	provider := w.RT.Provider()
	cmd := &busv1.Command{}
	ctx, err := bus.Decode(opCtx, msg, cmd)
	if err != nil {
		log.Error("terminating an undecodable command", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		w.Metrics.command(provider, "invalid")
		return
	}
	log = log.With("command", cmd.GetCommandId(), "operation", cmd.GetOperation().String(), "proxy_uid", cmd.GetProxyUid())
	if cmd.GetProvider() != provider {
		log.Error("terminating a command for another provider", "commandProvider", cmd.GetProvider())
		_ = msg.TermWithReason("wrong provider")
		w.Metrics.command(provider, "invalid")
		return
	}
	var deliveries uint64
	if md, err := msg.Metadata(); err == nil {
		deliveries = md.NumDelivered
	}
	if dl := cmd.GetDeadline(); dl != nil && dl.IsValid() && !time.Now().Before(dl.AsTime()) {
		log.WarnContext(ctx, "dropping a command past its deadline; the orchestrator issues it again",
			"deadline", dl.AsTime(), "deliveries", deliveries)
		_ = msg.Ack()
		w.Metrics.command(provider, "expired")
		return
	}
	// One span for the command, a child of the orchestrator's (from the
	// message headers): the operation's span and the result message, which
	// the orchestrator continues when it applies it, are its children.
	ctx, span := w.RT.tracer.Start(ctx, "provisioner.command", trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attribute.String("provisioner.provider", provider), attribute.String("command.id", cmd.GetCommandId()),
			attribute.String("command.operation", cmd.GetOperation().String()), attribute.String("command.purpose", cmd.GetPurpose().String())))
	defer span.End()
	execCtx := ctx
	if dl := cmd.GetDeadline(); dl != nil && dl.IsValid() {
		var cancel context.CancelFunc
		execCtx, cancel = context.WithDeadline(ctx, dl.AsTime())
		defer cancel()
	}

	hbDone := make(chan struct{})
	var hbWG sync.WaitGroup
	hbWG.Add(1)
	go func() {
		defer hbWG.Done()
		t := time.NewTicker(w.heartbeat())
		defer t.Stop()
		for {
			select {
			case <-hbDone:
				return
			case <-t.C:
				if err := msg.InProgress(); err != nil {
					log.Warn("heartbeating a command failed", "error", err)
				}
			}
		}
	}()
	start := time.Now()
	res := w.exec(execCtx, cmd)
	close(hbDone)
	hbWG.Wait()

	if opCtx.Err() != nil {
		// Shutting down and out of drain time: another replica finishes it.
		log.Warn("handing an unfinished command back for redelivery")
		_ = msg.Nak()
		w.Metrics.command(provider, "requeued")
		return
	}
	res.CommandId = cmd.GetCommandId()
	res.ProxyUid = cmd.GetProxyUid()
	res.Provider = provider
	res.SpecHash = cmd.GetSpecHash()
	res.Purpose = cmd.GetPurpose()
	res.Operation = cmd.GetOperation()
	res.HandledBy = w.ReplicaID
	res.CompleteTime = timestamppb.Now()
	res.Duration = durationpb.New(time.Since(start))

	pubCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if _, err := bus.Publish(pubCtx, w.JS, w.Names.ResultSubject(provider), res,
		jetstream.WithMsgID("result-"+cmd.GetCommandId())); err != nil {
		log.Warn("publishing a result failed; the command is redelivered", "error", err)
		_ = msg.NakWithDelay(time.Second)
		w.Metrics.command(provider, "publish_failed")
		return
	}
	if err := msg.DoubleAck(pubCtx); err != nil {
		log.Warn("acknowledging a command failed; it may run again", "error", err)
	}
	w.Metrics.command(provider, "done")
	attrs := []any{"deliveries", deliveries, "attempt", cmd.GetAttempt(), "duration", time.Since(start)}
	if e := res.GetError(); e != nil {
		attrs = append(attrs, "class", e.GetReason().String())
	}
	log.InfoContext(ctx, "command handled", attrs...)
}

// exec runs the command's operation and returns the result's outcome. A
// panicking backend answers a Transient error (Runtime recovers it) rather
// than crashing the replica, and every replica after it on redelivery.
func (w *Worker) exec(ctx context.Context, cmd *busv1.Command) (res *busv1.CommandResult) {
	res = &busv1.CommandResult{}
	fail := func(err error) *busv1.CommandResult {
		res.Outcome = &busv1.CommandResult_Error{Error: errclass.ToCommandError(err)}
		return res
	}
	// Commands obey the same contract rules as gRPC calls (pkg/validate).
	if req := commandRequest(cmd); req != nil {
		rules, err := commandRules()
		if err != nil {
			return fail(err)
		}
		if err := rules.Check(req); err != nil {
			return fail(errclass.New(errclass.Permanent, "%s", status.Convert(err).Message()))
		}
	}
	switch cmd.GetOperation() {
	case busv1.Operation_OPERATION_CREATE:
		req := cmd.GetCreate()
		if req == nil {
			return fail(errclass.New(errclass.Permanent, "a CREATE command without its create request"))
		}
		in, err := w.RT.Create(ctx, req)
		if err != nil {
			return fail(err)
		}
		res.Outcome = &busv1.CommandResult_Create{Create: &provisionerv1.CreateInstanceResponse{Instance: in}}
	case busv1.Operation_OPERATION_GET:
		req := cmd.GetGet()
		if req == nil {
			return fail(errclass.New(errclass.Permanent, "a GET command without its get request"))
		}
		in, err := w.RT.Get(ctx, req)
		if err != nil {
			return fail(err)
		}
		res.Outcome = &busv1.CommandResult_Get{Get: &provisionerv1.GetInstanceResponse{Instance: in}}
	case busv1.Operation_OPERATION_DELETE:
		req := cmd.GetDelete()
		if req == nil {
			return fail(errclass.New(errclass.Permanent, "a DELETE command without its delete request"))
		}
		deleted, err := w.RT.Delete(ctx, req)
		if err != nil {
			return fail(err)
		}
		res.Outcome = &busv1.CommandResult_Delete{Delete: &provisionerv1.DeleteInstanceResponse{Deleted: deleted}}
	case busv1.Operation_OPERATION_LIST:
		req := cmd.GetList()
		if req == nil {
			req = &provisionerv1.ListInstancesRequest{Provider: cmd.GetProvider()}
		}
		out, err := w.RT.List(ctx, req)
		if err != nil {
			return fail(err)
		}
		res.Outcome = &busv1.CommandResult_List{List: &provisionerv1.ListInstancesResponse{Instances: out}}
	case busv1.Operation_OPERATION_UPDATE_CREDENTIALS:
		req := cmd.GetUpdateCredentials()
		if req == nil {
			return fail(errclass.New(errclass.Permanent, "an UPDATE_CREDENTIALS command without its request"))
		}
		in, err := w.RT.UpdateCredentials(ctx, req)
		if err != nil {
			return fail(err)
		}
		res.Outcome = &busv1.CommandResult_UpdateCredentials{UpdateCredentials: &provisionerv1.UpdateCredentialsResponse{Instance: in}}
	default:
		return fail(errclass.New(errclass.Permanent, "unknown operation %s", cmd.GetOperation()))
	}
	return res
}

// commandRules checks commands' requests; built once, on first use.
var commandRules = sync.OnceValues(validate.New)

// commandRequest is the provisioner request a command carries, if any.
func commandRequest(cmd *busv1.Command) proto.Message {
	m := cmd.ProtoReflect()
	fd := m.WhichOneof(m.Descriptor().Oneofs().ByName("request"))
	if fd == nil {
		return nil
	}
	return m.Get(fd).Message().Interface()
}
