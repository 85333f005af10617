package provisioner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/grpctest"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

func TestMain(m *testing.M) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	goleak.VerifyTestMain(m)
}

// memBackend is an in-memory backend whose operations can be held.
type memBackend struct {
	mu        sync.Mutex
	instances map[string]*provisionerv1.Instance // by proxy UID
	calls     map[string]int                     // by op
	active    map[string]int                     // running ops by proxy UID
	maxActive int                                // most ops ever running at once for one UID
	started   chan string                        // receives "<op>/<uid>" when an op starts, if set
	hold      chan struct{}                      // ops wait for it to close, if set
	holdCtx   bool                               // ops wait for their context instead
	err       map[string]error                   // error by op
	minDur    time.Duration                      // each Create lasts at least this long
	nextVMID  int
	checker   bool
}

func newMem() *memBackend {
	return &memBackend{instances: map[string]*provisionerv1.Instance{}, calls: map[string]int{}, active: map[string]int{}, err: map[string]error{}, nextVMID: 100}
}

func (b *memBackend) enter(ctx context.Context, op, uid string) error {
	b.mu.Lock()
	b.calls[op]++
	b.active[uid]++
	b.maxActive = max(b.maxActive, b.active[uid])
	started, hold, holdCtx, minDur := b.started, b.hold, b.holdCtx, b.minDur
	b.mu.Unlock()
	if started != nil {
		started <- op + "/" + uid
	}
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if holdCtx {
		<-ctx.Done()
		return ctx.Err()
	}
	if op == "create" && minDur > 0 {
		t := time.NewTimer(minDur) // simulates a long clone, not synchronisation
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func (b *memBackend) leave(uid string) {
	b.mu.Lock()
	b.active[uid]--
	b.mu.Unlock()
}

func (b *memBackend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	defer b.leave(req.GetProxyUid())
	if err := b.enter(ctx, "create", req.GetProxyUid()); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.err["create"]; err != nil {
		return nil, err
	}
	if in, ok := b.instances[req.GetProxyUid()]; ok {
		return in, nil
	}
	in := &provisionerv1.Instance{
		ProviderId: fmt.Sprintf("vms/%d/proxy-%s", b.nextVMID, req.GetProxyUid()),
		ProxyUid:   req.GetProxyUid(), Name: "proxy-" + req.GetProxyUid(),
		State: provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, CreateTime: timestamppb.Now(),
	}
	b.nextVMID++
	b.instances[req.GetProxyUid()] = in
	return in, nil
}

func (b *memBackend) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	defer b.leave(req.GetProxyUid())
	if err := b.enter(ctx, "get", req.GetProxyUid()); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.err["get"]; err != nil {
		return nil, err
	}
	in, ok := b.instances[req.GetProxyUid()]
	if !ok || in.GetProviderId() != req.GetProviderId() {
		return nil, errclass.New(errclass.NotFound, "instance %s is gone", req.GetProviderId())
	}
	return in, nil
}

func (b *memBackend) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error) {
	defer b.leave(req.GetProxyUid())
	if err := b.enter(ctx, "delete", req.GetProxyUid()); err != nil {
		return false, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.err["delete"]; err != nil {
		return false, err
	}
	_, ok := b.instances[req.GetProxyUid()]
	delete(b.instances, req.GetProxyUid())
	return ok, nil
}

func (b *memBackend) List(ctx context.Context) ([]*provisionerv1.Instance, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.err["list"]; err != nil {
		return nil, err
	}
	var out []*provisionerv1.Instance
	for _, in := range b.instances {
		out = append(out, in)
	}
	return out, nil
}

func (b *memBackend) count(op string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.calls[op]
}

// checkingBackend adds a Checker.
type checkingBackend struct{ *memBackend }

func (checkingBackend) Check(context.Context) []*provisionerv1.TargetStatus {
	return []*provisionerv1.TargetStatus{{Name: "node-1", Ready: true, Reason: "Reachable"}}
}

// syncBuffer collects output written from several goroutines.
type syncBuffer = logtest.Buffer

func grpcClient(t *testing.T, rt *Runtime) provisionerv1.ProvisionerServiceClient {
	t.Helper()
	srv := grpc.NewServer()
	provisionerv1.RegisterProvisionerServiceServer(srv, &Server{RT: rt})
	return provisionerv1.NewProvisionerServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
}

func TestServerMapsErrorClasses(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		err        error
		wantCode   codes.Code
		wantReason string
	}{
		{"not found", errclass.New(errclass.NotFound, "VM 100 is gone"), codes.NotFound, "ERROR_REASON_NOT_FOUND"},
		{"permanent", errclass.New(errclass.Permanent, "Permission check failed (/vms/100, VM.Audit)"), codes.FailedPrecondition, "ERROR_REASON_PERMANENT"},
		{"transient", errclass.New(errclass.Transient, "VM is locked (clone)"), codes.Unavailable, "ERROR_REASON_TRANSIENT"},
		{"quota", errclass.New(errclass.QuotaExceeded, "Quota 'CPUS' exceeded"), codes.ResourceExhausted, "ERROR_REASON_QUOTA_EXCEEDED"},
		{"unclassified is transient", fmt.Errorf("connection reset"), codes.Unavailable, "ERROR_REASON_TRANSIENT"},
		{"canceled keeps its code and carries its reason", context.Canceled, codes.Canceled, "ERROR_REASON_TRANSIENT"},
		{"a request past its per-request timeout is transient", errclass.Wrap(errclass.Transient, fmt.Errorf("GET /cluster/resources: %w", context.DeadlineExceeded)),
			codes.Unavailable, "ERROR_REASON_TRANSIENT"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := newMem()
			b.err["get"] = tc.err
			client := grpcClient(t, NewRuntime(RuntimeOptions{Provider: "pve", Backend: b}))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: "vms/1/x", ProxyUid: "u"})
			st := status.Convert(err)
			if st.Code() != tc.wantCode {
				t.Fatalf("code = %v, want %v (%v)", st.Code(), tc.wantCode, err)
			}
			var reason string
			for _, d := range st.Details() {
				if info, ok := d.(*errdetails.ErrorInfo); ok {
					reason = info.GetReason()
				}
			}
			if reason != tc.wantReason {
				t.Errorf("ErrorInfo reason = %q, want %q", reason, tc.wantReason)
			}
		})
	}
}

func TestServerCheckBackend(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	without := grpcClient(t, NewRuntime(RuntimeOptions{Provider: "pve", Backend: newMem()}))
	if _, err := without.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: "pve"}); status.Code(err) != codes.Unimplemented {
		t.Errorf("a backend without a check: %v, want Unimplemented", err)
	}
	with := grpcClient(t, NewRuntime(RuntimeOptions{Provider: "pve", Backend: checkingBackend{newMem()}}))
	resp, err := with.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: "pve"})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetTargets()) != 1 || resp.GetTargets()[0].GetReason() != "Reachable" {
		t.Errorf("targets = %v", resp.GetTargets())
	}
	_, err = with.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: "other"})
	if errclass.Of(errclass.FromStatus(err)) != errclass.Permanent {
		t.Errorf("a check for another provider: %v, want Permanent", err)
	}
}

// hungChecker's check waits for its context, as a check of a backend that
// does not answer does, then reports Timeout with a message far over the
// bound.
type hungChecker struct{ *memBackend }

func (hungChecker) Check(ctx context.Context) []*provisionerv1.TargetStatus {
	<-ctx.Done()
	return []*provisionerv1.TargetStatus{{Name: "node-1", Reason: ReasonTimeout, Message: strings.Repeat("é", 3*MaxCheckMessage)}}
}

// The check of a hung backend answers the caller a verdict before the
// caller's deadline, its message cut to MaxCheckMessage characters.
func TestCheckAnswersBeforeTheCallersDeadline(t *testing.T) {
	t.Parallel()
	client := grpcClient(t, NewRuntime(RuntimeOptions{Provider: "pve", Backend: hungChecker{newMem()}}))
	for _, deadline := range []time.Duration{50 * time.Millisecond, 500 * time.Millisecond, 3 * time.Second} {
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		resp, err := client.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: "pve"})
		cancel()
		if err != nil {
			t.Fatalf("with a %s deadline: %v, want a verdict", deadline, err)
		}
		ts := resp.GetTargets()[0]
		if ts.GetReason() != ReasonTimeout || utf8.RuneCountInString(ts.GetMessage()) != MaxCheckMessage || !strings.HasSuffix(ts.GetMessage(), "é...") {
			t.Errorf("with a %s deadline: %s, a message of %d characters", deadline, ts.GetReason(), utf8.RuneCountInString(ts.GetMessage()))
		}
	}
}

// A check message with an invalid UTF-8 sequence (a backend's text as it
// came) is made valid, so the answer still encodes.
func TestTruncateMessageMakesValidUTF8(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"node \xff\xfe down", strings.Repeat("\xff", 2*MaxCheckMessage)} {
		got := truncateMessage(in)
		if !utf8.ValidString(got) || utf8.RuneCountInString(got) > MaxCheckMessage {
			t.Errorf("truncateMessage(%q...) = %q: want valid UTF-8 of at most %d characters", in[:8], got, MaxCheckMessage)
		}
		if _, err := proto.Marshal(&provisionerv1.TargetStatus{Name: "n", Message: got}); err != nil {
			t.Errorf("the status does not encode: %v", err)
		}
	}
}

func TestServerRoundTrip(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b := newMem()
	client := grpcClient(t, NewRuntime(RuntimeOptions{Provider: "pve", Backend: b}))
	cr, err := client.CreateInstance(ctx, &provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: "u1", CloudInit: "#cloud-config"})
	if err != nil {
		t.Fatal(err)
	}
	pid := cr.GetInstance().GetProviderId()
	if _, err := client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: pid, ProxyUid: "u1"}); err != nil {
		t.Fatal(err)
	}
	lr, err := client.ListInstances(ctx, &provisionerv1.ListInstancesRequest{Provider: "pve", Installation: "test"})
	if err != nil || len(lr.GetInstances()) != 1 {
		t.Fatalf("list = %v, %v", lr, err)
	}
	dr, err := client.DeleteInstance(ctx, &provisionerv1.DeleteInstanceRequest{Provider: "pve", Installation: "test", ProviderId: pid, ProxyUid: "u1"})
	if err != nil || !dr.GetDeleted() {
		t.Fatalf("delete = %v, %v", dr, err)
	}
	_, err = client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: pid, ProxyUid: "u1"})
	if status.Code(err) != codes.NotFound {
		t.Errorf("get after delete: %v, want NotFound", err)
	}
	if _, err := client.CreateInstance(ctx, &provisionerv1.CreateInstanceRequest{Provider: "pve"}); errclass.Of(errclass.FromStatus(err)) != errclass.Permanent {
		t.Errorf("create without a uid: %v, want Permanent", err)
	}
}

// A backend answering NotFound from Create breaks the contract; the runtime
// turns it into Transient rather than letting a proxy be recreated forever.
func TestCreateNeverAnswersNotFound(t *testing.T) {
	t.Parallel()
	b := newMem()
	b.err["create"] = errclass.New(errclass.NotFound, "template vanished")
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b})
	_, err := rt.Create(context.Background(), &provisionerv1.CreateInstanceRequest{ProxyUid: "u"})
	if errclass.Of(err) != errclass.Transient {
		t.Errorf("class = %v, want Transient", errclass.Of(err))
	}
}

func TestCreateAndDeleteOfOneProxyAreSerialised(t *testing.T) {
	t.Parallel()
	b := newMem()
	b.started = make(chan string, 10)
	b.hold = make(chan struct{})
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(3)
	go func() { defer wg.Done(); _, _ = rt.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "a"}) }()
	if got := <-b.started; got != "create/a" {
		t.Fatalf("first started %q", got)
	}
	go func() {
		defer wg.Done()
		_, _ = rt.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProxyUid: "a", ProviderId: "vms/100/proxy-a"})
	}()
	go func() { defer wg.Done(); _, _ = rt.Create(ctx, &provisionerv1.CreateInstanceRequest{ProxyUid: "b"}) }()
	// Another proxy goes ahead while "a" is held ...
	if got := <-b.started; got != "create/b" {
		t.Fatalf("while create/a runs, %q started; want create/b", got)
	}
	// ... and a's Delete starts only once its Create is released.
	select {
	case got := <-b.started:
		t.Fatalf("%q started while create/a still runs", got)
	default:
	}
	close(b.hold)
	if got := <-b.started; got != "delete/a" {
		t.Fatalf("after release %q started; want delete/a", got)
	}
	wg.Wait()
	if b.maxActive != 1 {
		t.Errorf("at most %d operations ran at once for one proxy, want 1", b.maxActive)
	}
}

func TestLockWaitEndsWithContext(t *testing.T) {
	t.Parallel()
	var k keyedMutex
	unlock, err := k.lock(context.Background(), "x")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := k.lock(ctx, "x"); errclass.Of(err) != errclass.Transient {
		t.Errorf("waiting with a cancelled context: %v", err)
	}
	unlock()
	unlock2, err := k.lock(context.Background(), "x")
	if err != nil {
		t.Fatal(err)
	}
	unlock2()
	if len(k.locks) != 0 {
		t.Errorf("%d locks left behind", len(k.locks))
	}
}

func TestMetricsAndLogs(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	var logs syncBuffer
	b := newMem()
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b, Metrics: m, Log: slog.New(slog.NewJSONHandler(&logs, nil))})
	ctx := context.Background()
	secret := "#cloud-config\npassword: hunter2-secret"
	in, err := rt.Create(ctx, &provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: "u1", CloudInit: secret})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = rt.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: "vms/9/none", ProxyUid: "u1"})
	b.err["delete"] = errclass.New(errclass.Permanent, "Permission check failed (/storage/seeds, Datastore.Allocate)")
	_, _ = rt.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "u1"})

	for _, tc := range []struct {
		op, result, class string
		want              float64
	}{
		{"create", "ok", "none", 1},
		{"get", "error", "ERROR_REASON_NOT_FOUND", 1},
		{"delete", "error", "ERROR_REASON_PERMANENT", 1},
		{"create", "error", "ERROR_REASON_TRANSIENT", 0},
	} {
		if got := testutil.ToFloat64(m.Requests.WithLabelValues("pve", tc.op, tc.result, tc.class)); got != tc.want {
			t.Errorf("requests{%s,%s,%s} = %v, want %v", tc.op, tc.result, tc.class, got, tc.want)
		}
	}
	if n := testutil.CollectAndCount(m.Duration); n != 3 {
		t.Errorf("%d duration series, want 3", n)
	}
	out := logs.String()
	if strings.Contains(out, "hunter2") {
		t.Errorf("the cloud-init reached the log:\n%s", out)
	}
	for _, want := range []string{`"provider":"pve"`, `"name":"proxy-u1"`, `"provider_id":"` + in.GetProviderId() + `"`, `"class":"ERROR_REASON_PERMANENT"`} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %s:\n%s", want, out)
		}
	}
}

// TestMetricsClassOfContextErrors: a context error the backend classified
// (its own request timed out, and it says Transient) is counted under its
// class, as its gRPC status reports it; only an unclassified one (the
// caller or a shutdown gave up) is "canceled".
func TestMetricsClassOfContextErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		err   error
		class string
	}{
		{"classified deadline", errclass.Wrap(errclass.Transient, fmt.Errorf("GET /api2/json/nodes: %w", context.DeadlineExceeded)), "ERROR_REASON_TRANSIENT"},
		{"classified cancel", errclass.Wrap(errclass.QuotaExceeded, context.Canceled), "ERROR_REASON_QUOTA_EXCEEDED"},
		{"unclassified deadline", fmt.Errorf("waiting for the clone: %w", context.DeadlineExceeded), "canceled"},
		{"unclassified cancel", context.Canceled, "canceled"},
		{"unclassified other", errors.New("connection reset"), "ERROR_REASON_TRANSIENT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			m := NewMetrics(prometheus.NewRegistry())
			b := newMem()
			b.err["get"] = tc.err
			rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b, Metrics: m})
			if _, err := rt.Get(context.Background(), &provisionerv1.GetInstanceRequest{ProviderId: "vms/9/none", ProxyUid: "u1"}); err == nil {
				t.Fatal("Get succeeded")
			}
			if got := testutil.ToFloat64(m.Requests.WithLabelValues("pve", "get", "error", tc.class)); got != 1 {
				t.Errorf("requests{get,error,%s} = %v, want 1", tc.class, got)
			}
			if n := testutil.CollectAndCount(m.Requests); n != 1 {
				t.Errorf("%d request series, want 1", n)
			}
		})
	}
}

// natsEnv is one test's NATS server with the suite's streams.
type natsEnv struct {
	srv   *natstest.Server
	js    jetstream.JetStream
	names bus.Names
}

func newNATS(t *testing.T) natsEnv {
	t.Helper()
	srv := natstest.New(t)
	js := srv.JetStream(t)
	names := bus.Names{Prefix: "t"}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := bus.EnsureStreams(ctx, js, names); err != nil {
		t.Fatal(err)
	}
	return natsEnv{srv: srv, js: js, names: names}
}

func (e natsEnv) publish(t *testing.T, ctx context.Context, cmd *busv1.Command) {
	t.Helper()
	if cmd.Deadline == nil {
		cmd.Deadline = timestamppb.New(time.Now().Add(time.Minute))
	}
	if _, err := bus.Publish(ctx, e.js, e.names.CommandSubject(cmd.GetProvider()), cmd, jetstream.WithMsgID(cmd.GetCommandId())); err != nil {
		t.Fatal(err)
	}
}

// results reads n results from the results stream within timeout.
func (e natsEnv) results(t *testing.T, n int, timeout time.Duration) []*busv1.CommandResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cons, err := e.js.CreateOrUpdateConsumer(ctx, e.names.ResultStream(), jetstream.ConsumerConfig{
		Durable: "test-results", AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: e.names.ResultSubjects(),
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []*busv1.CommandResult
	for len(out) < n {
		if ctx.Err() != nil {
			t.Fatalf("got %d results within %s, want %d", len(out), timeout, n)
		}
		batch, err := cons.Fetch(n-len(out), jetstream.FetchMaxWait(500*time.Millisecond))
		if err != nil {
			continue
		}
		for m := range batch.Messages() {
			res := &busv1.CommandResult{}
			if _, err := bus.Decode(ctx, m, res); err != nil {
				t.Fatal(err)
			}
			_ = m.Ack()
			out = append(out, res)
		}
	}
	return out
}

// runWorker runs a worker until the returned stop is called (or the test
// ends) and waits for it to return.
func runWorker(t *testing.T, w *Worker) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("worker: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func createCmd(id, uid string) *busv1.Command {
	return &busv1.Command{
		CommandId: id, ProxyUid: uid, Provider: "pve", SpecHash: "h-" + uid, Operation: busv1.Operation_OPERATION_CREATE, Attempt: 1,
		Purpose: busv1.CommandPurpose_COMMAND_PURPOSE_RECONCILE,
		Request: &busv1.Command_Create{Create: &provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: uid, CloudInit: "#cloud-config\nsecret: s3cr3t-" + uid}},
	}
}

func TestWorkerAnswersEveryOperation(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	b := newMem()
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b})
	runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1"})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	env.publish(t, ctx, createCmd("c1", "u1"))
	res := env.results(t, 1, 15*time.Second)[0]
	in := res.GetCreate().GetInstance()
	if in.GetProviderId() == "" {
		t.Fatalf("create result = %v", res)
	}
	if res.GetCommandId() != "c1" || res.GetProxyUid() != "u1" || res.GetProvider() != "pve" || res.GetSpecHash() != "h-u1" ||
		res.GetOperation() != busv1.Operation_OPERATION_CREATE || res.GetHandledBy() != "r1" || res.GetCompleteTime() == nil || res.GetDuration() == nil ||
		res.GetPurpose() != busv1.CommandPurpose_COMMAND_PURPOSE_RECONCILE {
		t.Errorf("result envelope not copied from the command: %v", res)
	}

	cases := []struct {
		name  string
		cmd   *busv1.Command
		check func(t *testing.T, r *busv1.CommandResult)
	}{
		{"get", &busv1.Command{CommandId: "c2", ProxyUid: "u1", Provider: "pve", Operation: busv1.Operation_OPERATION_GET,
			Request: &busv1.Command_Get{Get: &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: in.GetProviderId(), ProxyUid: "u1"}}},
			func(t *testing.T, r *busv1.CommandResult) {
				if r.GetGet().GetInstance().GetProviderId() != in.GetProviderId() {
					t.Errorf("get = %v", r)
				}
			}},
		{"list", &busv1.Command{CommandId: "c3", Provider: "pve", Operation: busv1.Operation_OPERATION_LIST,
			Purpose: busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC,
			Request: &busv1.Command_List{List: &provisionerv1.ListInstancesRequest{Provider: "pve", Installation: "test"}}},
			func(t *testing.T, r *busv1.CommandResult) {
				if len(r.GetList().GetInstances()) != 1 || r.GetProxyUid() != "" || r.GetPurpose() != busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC {
					t.Errorf("list = %v", r)
				}
			}},
		{"update credentials on a backend that cannot is Unsupported", &busv1.Command{CommandId: "c9", ProxyUid: "u1", Provider: "pve", Operation: busv1.Operation_OPERATION_UPDATE_CREDENTIALS,
			Request: &busv1.Command_UpdateCredentials{UpdateCredentials: &provisionerv1.UpdateCredentialsRequest{Provider: "pve", Installation: "test", ProviderId: in.GetProviderId(), ProxyUid: "u1"}}},
			func(t *testing.T, r *busv1.CommandResult) {
				if r.GetError().GetReason() != errclass.Unsupported || r.GetOperation() != busv1.Operation_OPERATION_UPDATE_CREDENTIALS {
					t.Errorf("result = %v", r)
				}
			}},
		{"delete", &busv1.Command{CommandId: "c4", ProxyUid: "u1", Provider: "pve", Operation: busv1.Operation_OPERATION_DELETE,
			Request: &busv1.Command_Delete{Delete: &provisionerv1.DeleteInstanceRequest{Provider: "pve", Installation: "test", ProviderId: in.GetProviderId(), ProxyUid: "u1"}}},
			func(t *testing.T, r *busv1.CommandResult) {
				if !r.GetDelete().GetDeleted() {
					t.Errorf("delete = %v", r)
				}
			}},
		{"get after delete is NotFound", &busv1.Command{CommandId: "c5", ProxyUid: "u1", Provider: "pve", Operation: busv1.Operation_OPERATION_GET,
			Request: &busv1.Command_Get{Get: &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: in.GetProviderId(), ProxyUid: "u1"}}},
			func(t *testing.T, r *busv1.CommandResult) {
				if errclass.Of(errclass.FromCommandError(r.GetError())) != errclass.NotFound {
					t.Errorf("get after delete = %v", r)
				}
			}},
		{"operation without its request is Permanent", &busv1.Command{CommandId: "c6", ProxyUid: "u1", Provider: "pve", Operation: busv1.Operation_OPERATION_CREATE},
			func(t *testing.T, r *busv1.CommandResult) {
				if r.GetError().GetReason() != errclass.Permanent {
					t.Errorf("result = %v", r)
				}
			}},
		{"a request breaking the contract is Permanent", &busv1.Command{CommandId: "c8", ProxyUid: "u2", Provider: "pve", Operation: busv1.Operation_OPERATION_CREATE,
			Request: &busv1.Command_Create{Create: &provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: "u2", ProxyName: "p2",
				Placement: &proxyv1.Placement{Zone: "pve1\n"}}}},
			func(t *testing.T, r *busv1.CommandResult) {
				if r.GetError().GetReason() != errclass.Permanent || !strings.Contains(r.GetError().GetMessage(), "placement.zone") {
					t.Errorf("result = %v", r)
				}
			}},
		{"unspecified operation is Permanent", &busv1.Command{CommandId: "c7", ProxyUid: "u1", Provider: "pve"},
			func(t *testing.T, r *busv1.CommandResult) {
				if r.GetError().GetReason() != errclass.Permanent {
					t.Errorf("result = %v", r)
				}
			}},
	}
	// Sequential on purpose: each step depends on the previous one.
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			env.publish(t, ctx, tc.cmd)
			r := env.results(t, 1, 15*time.Second)[0]
			if r.GetCommandId() != tc.cmd.GetCommandId() {
				t.Fatalf("result for %s, want %s", r.GetCommandId(), tc.cmd.GetCommandId())
			}
			tc.check(t, r)
		})
	}
}

// A worker started while NATS is down waits for it, then takes commands.
func TestWorkerWaitsOutNATS(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	var logs syncBuffer
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: newMem()})
	env.srv.Stop()
	runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1", Log: slog.New(slog.NewTextHandler(&logs, nil))})
	waittest.For(t, 30*time.Second, "WARNING while NATS was down", func() bool {
		return strings.Contains(logs.String(), "WARNING: consuming provisioner commands failed; retrying")
	})
	env.srv.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	env.publish(t, ctx, createCmd("c1", "u1"))
	if res := env.results(t, 1, 25*time.Second)[0]; res.GetCommandId() != "c1" || res.GetCreate().GetInstance().GetProviderId() == "" {
		t.Errorf("result = %v", res)
	}
}

func TestWorkerDropsCommandsPastTheirDeadline(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	b := newMem()
	var logs syncBuffer
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b})
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1", Metrics: m, Log: slog.New(slog.NewJSONHandler(&logs, nil))})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	late := createCmd("late", "u-late")
	late.Deadline = timestamppb.New(time.Now().Add(-time.Second))
	env.publish(t, ctx, late)
	env.publish(t, ctx, createCmd("fresh", "u-fresh"))
	res := env.results(t, 1, 15*time.Second)
	if res[0].GetCommandId() != "fresh" {
		t.Fatalf("result for %s", res[0].GetCommandId())
	}
	waittest.For(t, 10*time.Second, "the late command counted as expired", func() bool {
		return testutil.ToFloat64(m.Commands.WithLabelValues("pve", "expired")) == 1
	})
	if b.count("create") != 1 {
		t.Errorf("%d creates ran, want 1 (the late command must not start)", b.count("create"))
	}
	if !strings.Contains(logs.String(), "dropping a command past its deadline") {
		t.Errorf("no log line about the dropped command:\n%s", logs.String())
	}
	// The expired command was acked: nothing is pending on the consumer.
	cons, err := env.js.Consumer(ctx, env.names.CommandStream(), env.names.ProvisionerConsumer("pve"))
	if err != nil {
		t.Fatal(err)
	}
	waittest.For(t, 10*time.Second, "an empty consumer", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
}

func TestWorkersShareTheConsumer(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	shared := newMem()
	shared.started = make(chan string, 100)
	shared.hold = make(chan struct{})
	for _, id := range []string{"r1", "r2"} {
		rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: shared})
		runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: id, MaxConcurrent: 4})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := range 50 {
		env.publish(t, ctx, createCmd(fmt.Sprintf("c%02d", i), fmt.Sprintf("u%02d", i)))
	}
	// Eight Creates running at once need both replicas (four each).
	for range 8 {
		select {
		case <-shared.started:
		case <-ctx.Done():
			t.Fatal("eight creates never ran at once")
		}
	}
	close(shared.hold)
	go func() {
		for range shared.started {
		}
	}()
	res := env.results(t, 50, 45*time.Second)
	byReplica := map[string]int{}
	seenCmd := map[string]bool{}
	seenPID := map[string]bool{}
	for _, r := range res {
		byReplica[r.GetHandledBy()]++
		if seenCmd[r.GetCommandId()] {
			t.Errorf("two results for %s", r.GetCommandId())
		}
		seenCmd[r.GetCommandId()] = true
		pid := r.GetCreate().GetInstance().GetProviderId()
		if pid == "" || seenPID[pid] {
			t.Errorf("result %s: providerID %q missing or duplicated", r.GetCommandId(), pid)
		}
		seenPID[pid] = true
	}
	if byReplica["r1"] == 0 || byReplica["r2"] == 0 {
		t.Errorf("results by replica = %v, want both", byReplica)
	}
	if n := shared.count("create"); n != 50 {
		t.Errorf("%d creates ran, want 50", n)
	}
	close(shared.started)
}

func TestWorkerHeartbeatsLongOperations(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	b := newMem()
	b.minDur = 3 * time.Second // three ack waits
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b})
	runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1", AckWait: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	env.publish(t, ctx, createCmd("c1", "u1"))
	res := env.results(t, 1, 15*time.Second)
	if res[0].GetCreate() == nil {
		t.Fatalf("result = %v", res[0])
	}
	if n := b.count("create"); n != 1 {
		t.Errorf("the command ran %d times; heartbeats should have kept it from redelivery", n)
	}
}

func TestShutdownFinishesInFlightCommands(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	b := newMem()
	b.started = make(chan string, 1)
	b.hold = make(chan struct{})
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: b})
	stop := runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1", DrainTimeout: 30 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	env.publish(t, ctx, createCmd("c1", "u1"))
	<-b.started
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	select {
	case <-stopped:
		t.Fatal("the worker stopped with a command in flight")
	default:
	}
	close(b.hold)
	<-stopped
	res := env.results(t, 1, 15*time.Second)
	if res[0].GetHandledBy() != "r1" || res[0].GetCreate() == nil {
		t.Errorf("result = %v", res[0])
	}
}

func TestShutdownHandsBackUnfinishedCommands(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	stuck := newMem()
	stuck.started = make(chan string, 1)
	stuck.holdCtx = true
	rt1 := NewRuntime(RuntimeOptions{Provider: "pve", Backend: stuck})
	// AckWait is long: only a Nak can bring the command back within the test.
	stop1 := runWorker(t, &Worker{RT: rt1, JS: env.js, Names: env.names, ReplicaID: "r1", AckWait: 5 * time.Minute, DrainTimeout: 100 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	env.publish(t, ctx, createCmd("c1", "u1"))
	<-stuck.started
	stop1()

	rt2 := NewRuntime(RuntimeOptions{Provider: "pve", Backend: newMem()})
	runWorker(t, &Worker{RT: rt2, JS: env.js, Names: env.names, ReplicaID: "r2", AckWait: 5 * time.Minute})
	res := env.results(t, 1, 20*time.Second)
	if res[0].GetHandledBy() != "r2" || res[0].GetCreate() == nil {
		t.Errorf("result = %v, want r2's create", res[0])
	}
}

func TestWorkerContinuesTheCommandsTrace(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: newMem(), TracerProvider: tp})
	runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1"})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pctx, parent := tp.Tracer("test").Start(ctx, "orchestrator.dispatch")
	env.publish(t, pctx, createCmd("c1", "u1"))
	parent.End()
	env.results(t, 1, 15*time.Second)
	// publisher → provisioner.command → provisioner.create; the command's
	// span ends once the result is published and the command acked.
	spans := map[string]sdktrace.ReadOnlySpan{}
	waittest.For(t, 10*time.Second, "provisioner.command and provisioner.create spans", func() bool {
		for _, s := range rec.Ended() {
			spans[s.Name()] = s
		}
		return spans["provisioner.command"] != nil && spans["provisioner.create"] != nil
	})
	command, create := spans["provisioner.command"], spans["provisioner.create"]
	if command.Parent().TraceID() != parent.SpanContext().TraceID() || command.Parent().SpanID() != parent.SpanContext().SpanID() {
		t.Errorf("provisioner.command parent = %v, want the publisher's span %v", command.Parent(), parent.SpanContext())
	}
	if create.Parent().SpanID() != command.SpanContext().SpanID() || create.SpanContext().TraceID() != parent.SpanContext().TraceID() {
		t.Errorf("provisioner.create parent = %v, want provisioner.command %v", create.Parent(), command.SpanContext())
	}
	var found bool
	for _, s := range rec.Ended() {
		if s.Name() == "provisioner.create" || s.Name() == "provisioner.command" {
			found = true
			for _, a := range s.Attributes() {
				if strings.Contains(a.Value.Emit(), "s3cr3t") {
					t.Errorf("span attribute %s carries the cloud-init", a.Key)
				}
			}
		}
	}
	if !found {
		t.Error("no provisioner.create span")
	}
}

func TestWorkerBoundsConcurrency(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	b := newMem()
	b.started = make(chan string, 20)
	b.hold = make(chan struct{})
	var mu sync.Mutex
	running, most := 0, 0
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: countingBackend{b, func(d int) {
		mu.Lock()
		running += d
		most = max(most, running)
		mu.Unlock()
	}}})
	runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1", MaxConcurrent: 3})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 10 {
		env.publish(t, ctx, createCmd(fmt.Sprintf("c%d", i), fmt.Sprintf("u%d", i)))
	}
	for range 3 {
		<-b.started
	}
	// Three run; the fourth must wait for a slot. Give the worker the
	// chance to (wrongly) start it: the consumer holds 7 more messages.
	waittest.For(t, 10*time.Second, "seven pending commands", func() bool {
		cons, err := env.js.Consumer(ctx, env.names.CommandStream(), env.names.ProvisionerConsumer("pve"))
		if err != nil {
			return false
		}
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 7 && info.NumAckPending == 3
	})
	close(b.hold)
	env.results(t, 10, 20*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if most != 3 {
		t.Errorf("at most %d creates ran at once, want 3", most)
	}
}

// countingBackend reports entries and exits of Create.
type countingBackend struct {
	*memBackend
	delta func(int)
}

func (c countingBackend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	c.delta(1)
	defer c.delta(-1)
	return c.memBackend.Create(ctx, req)
}

// panicBackend panics in Get.
type panicBackend struct{ *memBackend }

func (panicBackend) Get(context.Context, *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	panic("boom")
}

func TestWorkerTerminatesBadCommandsAndSurvivesPanics(t *testing.T) {
	t.Parallel()
	env := newNATS(t)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	var logs syncBuffer
	rt := NewRuntime(RuntimeOptions{Provider: "pve", Backend: panicBackend{newMem()}, Metrics: m, Log: slog.New(slog.NewJSONHandler(&logs, nil))})
	runWorker(t, &Worker{RT: rt, JS: env.js, Names: env.names, ReplicaID: "r1", Metrics: m})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// Not a protobuf Command.
	if _, err := env.js.Publish(ctx, env.names.CommandSubject("pve"), []byte{0xff, 0xff, 0xff}); err != nil {
		t.Fatal(err)
	}
	// A command naming another provider on this provider's subject.
	wrong := createCmd("w1", "u1")
	wrong.Provider = "other"
	m1, err := bus.Message(ctx, env.names.CommandSubject("pve"), wrong)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := env.js.PublishMsg(ctx, m1); err != nil {
		t.Fatal(err)
	}
	// A Get whose backend panics.
	env.publish(t, ctx, &busv1.Command{CommandId: "p1", ProxyUid: "u1", Provider: "pve", Operation: busv1.Operation_OPERATION_GET,
		Request: &busv1.Command_Get{Get: &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: "vms/1/x", ProxyUid: "u1"}}})
	res := env.results(t, 1, 15*time.Second)[0]
	if res.GetCommandId() != "p1" || res.GetError().GetReason() != errclass.Transient {
		t.Errorf("result = %v, want p1's Transient error", res)
	}
	waittest.For(t, 10*time.Second, "two invalid commands", func() bool {
		return testutil.ToFloat64(m.Commands.WithLabelValues("pve", "invalid")) == 2
	})
	// The panic is recorded as the failure it is, not as a success.
	if n := testutil.ToFloat64(m.Requests.WithLabelValues("pve", "get", "error", "ERROR_REASON_TRANSIENT")); n != 1 {
		t.Errorf("failed gets recorded = %v, want 1", n)
	}
	if n := testutil.ToFloat64(m.Requests.WithLabelValues("pve", "get", "ok", "none")); n != 0 {
		t.Errorf("successful gets recorded = %v, want 0", n)
	}
	for _, want := range []string{`"msg":"the backend panicked"`, `"panic":"boom"`, `"msg":"provisioner operation failed"`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %s:\n%s", want, logs.String())
		}
	}
}

// A backend that panics under a gRPC call answers UNAVAILABLE (Transient),
// and the replica serves the next call.
func TestServerSurvivesBackendPanics(t *testing.T) {
	t.Parallel()
	client := grpcClient(t, NewRuntime(RuntimeOptions{Provider: "pve", Backend: panicBackend{newMem()}}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for range 2 {
		_, err := client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: "vms/1/x", ProxyUid: "u"})
		if st := status.Convert(err); st.Code() != codes.Unavailable || strings.Contains(st.Message(), "boom") {
			t.Fatalf("GetInstance on a panicking backend: %v, want UNAVAILABLE without the panic value", err)
		}
	}
	if _, err := client.ListInstances(ctx, &provisionerv1.ListInstancesRequest{Provider: "pve", Installation: "test"}); err != nil {
		t.Errorf("ListInstances after the panics: %v", err)
	}
}

// List keeps the request's installation's instances and those whose mark
// names none; another installation's never leave the provisioner.
func TestListKeepsItsInstallation(t *testing.T) {
	t.Parallel()
	all := []*provisionerv1.Instance{
		{ProviderId: "ours", Installation: "prod"},
		{ProviderId: "legacy"},
		{ProviderId: "theirs", Installation: "staging"},
	}
	var got []string
	for _, in := range ofInstallation(all, "prod") {
		got = append(got, in.GetProviderId())
	}
	if want := []string{"ours", "legacy"}; !slices.Equal(got, want) {
		t.Errorf("List for prod kept %v, want %v", got, want)
	}
	if len(all) != 3 || all[2].GetProviderId() != "theirs" {
		t.Errorf("the backend's list was changed: %v", all)
	}
}
