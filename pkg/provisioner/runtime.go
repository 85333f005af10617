// Package provisioner is the runtime every backend provisioner shares
// (Proxmox, KVM, GCP, local). A backend implements Backend, and optionally
// Checker; the runtime serves it twice over:
//
//   - as a NATS worker on the provider's shared durable JetStream consumer
//     (Worker): explicit acks, heartbeats (InProgress) while an operation
//     runs, bounded concurrency, commands past their deadline dropped, a
//     CommandResult published for every command it executes, and in-flight
//     work either finished or handed back (Nak) at shutdown;
//   - as the gRPC ProvisionerService (Server).
//
// Both go through Runtime, which serialises Create and Delete for one proxy
// inside the process, maps the error taxonomy once (errclass), counts and
// times every request, opens a span continuing the caller's trace and logs
// the outcome with provider, name and providerID. Main wires it all into a
// service binary.
package provisioner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Backend is one backend's implementation of the contract. Every method
// must be idempotent and return errors classified with errclass (an
// unclassified error counts as Transient). Create never returns NotFound.
//
// Every request names its installation (pkg/installation), which the
// backend writes into the marks it makes. Create, Get and Delete treat an
// instance whose mark names another installation as foreign (Create
// Permanent, Get NotFound, Delete leaves it); one whose mark names no
// installation but the request's proxy is the proxy's: Create and Get
// claim it by writing the installation into its mark.
type Backend interface {
	// Create creates the proxy's instance, or adopts and finishes one an
	// earlier attempt left, and returns it once it runs.
	Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error)
	// Get returns the instance, NotFound when it is gone or not the proxy's.
	Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error)
	// Delete removes the instance and what was created with it; it reports
	// false when there was nothing of the proxy's left.
	Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error)
	// List returns every instance carrying the system's mark, of every
	// installation, each with the installation its mark names (empty for a
	// mark from before installations); the Runtime keeps the request's.
	List(ctx context.Context) ([]*provisionerv1.Instance, error)
}

// CredentialsUpdater is implemented by backends that can make a running
// instance demand new credentials in place (the proxy program is theirs to
// reconfigure); for the others, the runtime answers Unsupported and the
// orchestrator replaces the instance.
type CredentialsUpdater interface {
	// UpdateCredentials makes the instance refuse every credential but
	// req's by the time it returns, and returns the instance. NotFound when
	// it is gone or not the proxy's.
	UpdateCredentials(ctx context.Context, req *provisionerv1.UpdateCredentialsRequest) (*provisionerv1.Instance, error)
}

// Checker is implemented by backends that can check their own health.
type Checker interface {
	// Check returns one verdict per target, in config order. It never
	// fails as a whole.
	Check(ctx context.Context) []*provisionerv1.TargetStatus
}

// Op names an operation in metrics, spans and logs.
type Op string

// The operations.
const (
	OpCreate Op = "create"
	OpGet    Op = "get"
	OpDelete Op = "delete"
	OpList   Op = "list"
	OpCheck  Op = "check"
	// OpUpdateCredentials is UpdateCredentials.
	OpUpdateCredentials Op = "update-credentials"
)

// Runtime runs backend operations with the cross-cutting behaviour every
// transport shares. Build it with NewRuntime.
type Runtime struct {
	provider  string
	backendMu sync.RWMutex
	backend   Backend
	log       *slog.Logger
	tracer    trace.Tracer
	metrics   *Metrics
	locks     keyedMutex
	creds     CredentialsSource
}

// RuntimeOptions configure a Runtime.
type RuntimeOptions struct {
	// Provider is the configured provider name this process serves.
	Provider string
	// Backend executes the operations.
	Backend Backend
	// Log receives one line per operation; provider is added to it.
	Log *slog.Logger
	// Metrics, when set, counts and times every request.
	Metrics *Metrics
	// TracerProvider opens the operation spans (the global one by default).
	TracerProvider trace.TracerProvider
	// Credentials fetches a proxy's credentials for Create; nil: a Create
	// carries only the credentials its request has (none from NATS).
	Credentials CredentialsSource
}

// NewRuntime returns a Runtime.
func NewRuntime(o RuntimeOptions) *Runtime {
	tp := o.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Runtime{
		provider: o.Provider,
		backend:  o.Backend,
		log:      log.With("provider", o.Provider),
		tracer:   tp.Tracer("github.com/egress-proxies/egress-proxies/pkg/provisioner"),
		metrics:  o.Metrics,
		creds:    o.Credentials,
	}
}

// Provider is the provider name served.
func (r *Runtime) Provider() string { return r.provider }

// Backend is the backend operations run on now.
func (r *Runtime) Backend() Backend {
	r.backendMu.RLock()
	defer r.backendMu.RUnlock()
	return r.backend
}

// SetBackend replaces the backend (its provider's entry in the providers
// config changed); operations already running finish on the old one.
func (r *Runtime) SetBackend(b Backend) {
	r.backendMu.Lock()
	r.backend = b
	r.backendMu.Unlock()
}

// HasCheck reports whether the backend implements Checker.
func (r *Runtime) HasCheck() bool {
	_, ok := r.Backend().(Checker)
	return ok
}

func (r *Runtime) checkProvider(got string) error {
	if got != "" && got != r.provider {
		return errclass.New(errclass.Permanent, "this provisioner serves provider %q, not %q", r.provider, got)
	}
	return nil
}

// begin opens the operation's span and returns a function that ends it,
// records metrics and logs the outcome.
func (r *Runtime) begin(ctx context.Context, op Op, attrs ...slog.Attr) (context.Context, func(err error, more ...slog.Attr)) {
	start := time.Now()
	spanAttrs := []attribute.KeyValue{attribute.String("provisioner.provider", r.provider)}
	for _, a := range attrs {
		spanAttrs = append(spanAttrs, attribute.String("provisioner."+a.Key, a.Value.String()))
	}
	ctx, span := r.tracer.Start(ctx, "provisioner."+string(op), trace.WithAttributes(spanAttrs...))
	r.metrics.inflight(r.provider, op, 1)
	return ctx, func(err error, more ...slog.Attr) {
		d := time.Since(start)
		r.metrics.inflight(r.provider, op, -1)
		r.metrics.observe(r.provider, op, err, d)
		all := append([]slog.Attr{slog.String("op", string(op))}, attrs...)
		for _, a := range more {
			dup := false
			for _, b := range attrs {
				dup = dup || b.Key == a.Key
			}
			if !dup {
				all = append(all, a)
			}
		}
		all = append(all, slog.Duration("duration", d))
		for _, a := range more {
			span.SetAttributes(attribute.String("provisioner."+a.Key, a.Value.String()))
		}
		if err != nil {
			class := errclass.Of(err)
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(attribute.String("provisioner.error_class", class.String()))
			all = append(all, slog.String("class", class.String()), slog.String("error", err.Error()))
			level := slog.LevelWarn
			if class == errclass.NotFound || errors.Is(err, context.Canceled) {
				level = slog.LevelInfo
			}
			r.log.LogAttrs(ctx, level, "provisioner operation failed", all...)
		} else {
			// Create and Delete change things: INFO. Reads are frequent
			// (the orchestrator polls Get while a proxy provisions): DEBUG.
			level := slog.LevelDebug
			if op == OpCreate || op == OpDelete {
				level = slog.LevelInfo
			}
			r.log.LogAttrs(ctx, level, "provisioner operation done", all...)
		}
		span.End()
	}
}

func instanceAttrs(in *provisionerv1.Instance) []slog.Attr {
	if in == nil {
		return nil
	}
	return []slog.Attr{
		slog.String("name", in.GetName()),
		slog.String("provider_id", in.GetProviderId()),
		slog.String("state", in.GetState().String()),
	}
}

// recovered turns a backend's panic into a Transient error, so that the
// operation is recorded and answered as failed (the orchestrator tries
// again, perhaps on another replica) and the replica lives on. The panic
// and its stack go to the log only, not into the answer.
func (r *Runtime) recovered(ctx context.Context, op Op, p any) error {
	r.log.ErrorContext(ctx, "the backend panicked", "operation", string(op), "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
	return errclass.New(errclass.Transient, "internal error in the %s provisioner", r.provider)
}

// lockKey is what Create and Delete serialise on: the proxy, whose UID
// determines the instance's name on every backend.
func lockKey(proxyUID, providerID string) string {
	if proxyUID != "" {
		return "uid/" + proxyUID
	}
	return "pid/" + providerID
}

// Create runs Backend.Create under the proxy's lock.
func (r *Runtime) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (in *provisionerv1.Instance, err error) {
	ctx, end := r.begin(ctx, OpCreate, slog.String("proxy_uid", req.GetProxyUid()), slog.String("proxy_name", req.GetProxyName()))
	defer func() {
		if p := recover(); p != nil {
			err = r.recovered(ctx, OpCreate, p)
		}
		end(err, instanceAttrs(in)...)
	}()
	if err := r.checkProvider(req.GetProvider()); err != nil {
		return nil, err
	}
	if req.GetProxyUid() == "" {
		return nil, errclass.New(errclass.Permanent, "proxy_uid is required")
	}
	if req, err = r.withCredentials(ctx, req); err != nil {
		return nil, err
	}
	unlock, err := r.locks.lock(ctx, lockKey(req.GetProxyUid(), ""))
	if err != nil {
		return nil, err
	}
	defer unlock()
	in, err = r.Backend().Create(ctx, req)
	if errclass.Is(err, errclass.NotFound) {
		// The contract forbids NotFound from Create; a backend that says it
		// means something it depends on vanished mid-way.
		err = errclass.Wrap(errclass.Transient, err)
	}
	return in, err
}

// UpdateCredentials runs the backend's UpdateCredentials under the proxy's
// lock, with the proxy's current credentials; Unsupported when the backend
// has none.
func (r *Runtime) UpdateCredentials(ctx context.Context, req *provisionerv1.UpdateCredentialsRequest) (in *provisionerv1.Instance, err error) {
	ctx, end := r.begin(ctx, OpUpdateCredentials, slog.String("proxy_uid", req.GetProxyUid()), slog.String("provider_id", req.GetProviderId()))
	defer func() {
		if p := recover(); p != nil {
			err = r.recovered(ctx, OpUpdateCredentials, p)
		}
		end(err, instanceAttrs(in)...)
	}()
	if err := r.checkProvider(req.GetProvider()); err != nil {
		return nil, err
	}
	if req.GetProxyUid() == "" || req.GetProviderId() == "" {
		return nil, errclass.New(errclass.Permanent, "proxy_uid and provider_id are required")
	}
	u, ok := r.Backend().(CredentialsUpdater)
	if !ok {
		return nil, errclass.New(errclass.Unsupported, "provider %q cannot change an instance's credentials in place; replace the instance instead", r.provider)
	}
	if req, err = r.withNewCredentials(ctx, req); err != nil {
		return nil, err
	}
	unlock, err := r.locks.lock(ctx, lockKey(req.GetProxyUid(), ""))
	if err != nil {
		return nil, err
	}
	defer unlock()
	return u.UpdateCredentials(ctx, req)
}

// Get runs Backend.Get. It takes no lock.
func (r *Runtime) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (in *provisionerv1.Instance, err error) {
	ctx, end := r.begin(ctx, OpGet, slog.String("proxy_uid", req.GetProxyUid()), slog.String("provider_id", req.GetProviderId()))
	defer func() {
		if p := recover(); p != nil {
			err = r.recovered(ctx, OpGet, p)
		}
		end(err, instanceAttrs(in)...)
	}()
	if err := r.checkProvider(req.GetProvider()); err != nil {
		return nil, err
	}
	return r.Backend().Get(ctx, req)
}

// Delete runs Backend.Delete under the proxy's lock.
func (r *Runtime) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (deleted bool, err error) {
	ctx, end := r.begin(ctx, OpDelete, slog.String("proxy_uid", req.GetProxyUid()), slog.String("provider_id", req.GetProviderId()))
	defer func() {
		if p := recover(); p != nil {
			err = r.recovered(ctx, OpDelete, p)
		}
		end(err, slog.Bool("deleted", deleted))
	}()
	if err := r.checkProvider(req.GetProvider()); err != nil {
		return false, err
	}
	unlock, err := r.locks.lock(ctx, lockKey(req.GetProxyUid(), req.GetProviderId()))
	if err != nil {
		return false, err
	}
	defer unlock()
	return r.Backend().Delete(ctx, req)
}

// List runs Backend.List.
func (r *Runtime) List(ctx context.Context, req *provisionerv1.ListInstancesRequest) (out []*provisionerv1.Instance, err error) {
	ctx, end := r.begin(ctx, OpList)
	defer func() {
		if p := recover(); p != nil {
			err = r.recovered(ctx, OpList, p)
		}
		end(err, slog.Int("instances", len(out)))
	}()
	if err := r.checkProvider(req.GetProvider()); err != nil {
		return nil, err
	}
	all, err := r.Backend().List(ctx)
	if err != nil {
		return nil, err
	}
	return ofInstallation(all, req.GetInstallation()), nil
}

// ofInstallation keeps the instances of installation and those whose mark
// names none (marked before marks did; orphan GC leaves them to their own
// proxy): another installation's instances never leave the provisioner.
func ofInstallation(all []*provisionerv1.Instance, installation string) []*provisionerv1.Instance {
	out := all[:0:0]
	for _, in := range all {
		if in.GetInstallation() == "" || in.GetInstallation() == installation {
			out = append(out, in)
		}
	}
	return out
}

// ErrNoCheck is returned by Check when the backend has none.
var ErrNoCheck = errors.New("this backend has no check")

// Check runs the backend's Checker within the caller's deadline less a
// margin, or DefaultCheckTimeout (checkContext), and cuts each message to
// MaxCheckMessage.
func (r *Runtime) Check(ctx context.Context, req *provisionerv1.CheckBackendRequest) (out []*provisionerv1.TargetStatus, err error) {
	c, ok := r.Backend().(Checker)
	if !ok {
		return nil, ErrNoCheck
	}
	ctx, end := r.begin(ctx, OpCheck)
	defer func() {
		if p := recover(); p != nil {
			err = r.recovered(ctx, OpCheck, p)
		}
		ready := 0
		for _, t := range out {
			if t.GetReady() {
				ready++
			}
		}
		end(err, slog.Int("targets", len(out)), slog.Int("ready", ready))
	}()
	if err := r.checkProvider(req.GetProvider()); err != nil {
		return nil, err
	}
	ctx, cancel := checkContext(ctx)
	defer cancel()
	out = c.Check(ctx)
	for _, t := range out {
		t.Message = truncateMessage(t.GetMessage())
	}
	return out, nil
}

// DefaultCheckTimeout bounds a check whose caller gives no deadline.
const DefaultCheckTimeout = 15 * time.Second

// The share of the caller's remaining time a check leaves for its answer
// to travel back, within these bounds.
const (
	checkMarginMin = 100 * time.Millisecond
	checkMarginMax = time.Second
)

// checkContext bounds a check by the caller's deadline minus a margin, so
// that a backend that times out answers a Timeout verdict while the caller
// still waits, never the caller's own DEADLINE_EXCEEDED; without a
// deadline, by DefaultCheckTimeout.
func checkContext(ctx context.Context) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return context.WithTimeout(ctx, DefaultCheckTimeout)
	}
	margin := min(max(time.Until(deadline)/10, checkMarginMin), checkMarginMax)
	return context.WithDeadline(ctx, deadline.Add(-margin))
}

// keyedMutex is a set of mutexes by key, each waitable with a context.
type keyedMutex struct {
	mu    sync.Mutex
	locks map[string]*keyLock
}

type keyLock struct {
	ch   chan struct{} // holds one token while locked
	refs int
}

func (k *keyedMutex) lock(ctx context.Context, key string) (func(), error) {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*keyLock{}
	}
	l := k.locks[key]
	if l == nil {
		l = &keyLock{ch: make(chan struct{}, 1)}
		k.locks[key] = l
	}
	l.refs++
	k.mu.Unlock()
	release := func() {
		k.mu.Lock()
		l.refs--
		if l.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
	select {
	case l.ch <- struct{}{}:
		return func() { <-l.ch; release() }, nil
	case <-ctx.Done():
		release()
		return nil, errclass.Wrap(errclass.Transient, context.Cause(ctx))
	}
}
