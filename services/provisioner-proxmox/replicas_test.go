package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/proctest"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/provisionertest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

const cloudSecret = "cl0ud-1n1t-pr0c3ss-s3cr3t"

// cluster is a fake Proxmox, NATS and the providers file for processes.
type cluster struct {
	fake   *pvefake.Server
	nats   *natstest.Server
	js     jetstream.JetStream
	names  bus.Names
	config string
	// apiTokens is the provisioners' token file: svc-token (service),
	// ops-token (admin) and crawler-token (crawler).
	apiTokens string
}

func newCluster(t testing.TB) *cluster {
	t.Helper()
	p := newPVE(t)
	ns := natstest.New(t)
	c := &cluster{fake: p.Server, nats: ns, js: ns.JetStream(t), names: bus.Names{Prefix: "it"},
		config:    provisionertest.ProvidersFile(t, provisionertest.Provider{Name: "pve", Type: "proxmox", Block: p.block(p.URL)}),
		apiTokens: provisionertest.WriteFile(t, "api-tokens", "health svc-token service\nops ops-token admin\nfleet crawler-token crawler,viewer\n")}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := bus.EnsureStreams(ctx, c.js, c.names); err != nil {
		t.Fatal(err)
	}
	return c
}

// start runs one provisioner process and returns it with its gRPC address.
func (c *cluster) start(t testing.TB, replica string, extra ...string) *proctest.Process {
	p, _, _ := c.startAddr(t, replica, extra...)
	return p
}

// startAddr also returns the gRPC and HTTP addresses.
func (c *cluster) startAddr(t testing.TB, replica string, extra ...string) (*proctest.Process, string, string) {
	t.Helper()
	args := append([]string{"--grpc-listen=127.0.0.1:0", "--http-listen=127.0.0.1:0",
		"--providers-config=" + c.config, "--provider=pve", "--nats-url=" + c.nats.URL(),
		"--nats-prefix=" + c.names.Prefix, "--replica-id=" + replica, "--log-level=debug-4", "--auth-token-file=" + c.apiTokens}, extra...)
	p := proctest.Start(t, proctest.Build(t, "."), args)
	serving := p.WaitLog(t, 60*time.Second, proctest.Msg("serving"))
	p.WaitLog(t, 30*time.Second, proctest.Msg("taking provisioner commands"))
	grpcAddr, _ := serving["grpc"].(string)
	httpAddr, _ := serving["http"].(string)
	return p, grpcAddr, httpAddr
}

func (c *cluster) publishCreate(t testing.TB, id, uid string) {
	t.Helper()
	cmd := &busv1.Command{
		CommandId: id, ProxyUid: uid, Provider: "pve", SpecHash: "h", Operation: busv1.Operation_OPERATION_CREATE, Attempt: 1,
		Deadline: timestamppb.New(time.Now().Add(5 * time.Minute)), IssueTime: timestamppb.Now(),
		Request: &busv1.Command_Create{Create: &provisionerv1.CreateInstanceRequest{
			Provider: "pve", Installation: "test", ProxyUid: uid, ProxyName: "p", CloudInit: "#cloud-config\n# " + cloudSecret + "\n", Port: 3128,
			Placement: &proxyv1.Placement{MachineType: "small", Image: "debian-13"},
		}},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := bus.Publish(ctx, c.js, c.names.CommandSubject("pve"), cmd, jetstream.WithMsgID(id)); err != nil {
		t.Fatal(err)
	}
}

func (c *cluster) results(t testing.TB, n int, timeout time.Duration) []*busv1.CommandResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cons, err := c.js.CreateOrUpdateConsumer(ctx, c.names.ResultStream(), jetstream.ConsumerConfig{
		Durable: "test", AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: c.names.ResultSubjects(),
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []*busv1.CommandResult
	for len(out) < n {
		if ctx.Err() != nil {
			t.Fatalf("%d results within %s, want %d", len(out), timeout, n)
		}
		batch, err := cons.Fetch(n-len(out), jetstream.FetchMaxWait(time.Second))
		if err != nil {
			continue
		}
		for m := range batch.Messages() {
			r := &busv1.CommandResult{}
			if _, err := bus.Decode(ctx, m, r); err != nil {
				t.Fatal(err)
			}
			_ = m.Ack()
			out = append(out, r)
		}
	}
	return out
}

func assertNoSecrets(t *testing.T, c *cluster, procs ...*proctest.Process) {
	t.Helper()
	for _, p := range procs {
		out := p.Output()
		for what, s := range map[string]string{"token secret": tokenSecret, "cloud-init": cloudSecret, "CA content": strings.Split(string(c.fake.CAPEM), "\n")[1]} {
			if strings.Contains(out, s) {
				t.Errorf("the %s reached a process log", what)
			}
		}
	}
}

// Two provisioner processes on one consumer share 50 Creates: every proxy
// gets exactly one VM, no VMID twice, and both replicas work.
func TestTwoProcessesShareFiftyCreates(t *testing.T) {
	t.Parallel()
	c := newCluster(t)
	// Hold the clones until eight run at once: both replicas (four each)
	// are then busy, so the split cannot be one-sided.
	c.fake.HoldClones()
	started := c.fake.CloneStarted()
	a := c.start(t, "a", "--max-concurrent=4")
	b := c.start(t, "b", "--max-concurrent=4")
	for i := range 50 {
		c.publishCreate(t, fmt.Sprintf("cmd-%02d", i), fmt.Sprintf("0f3a6c1e-2b4d-4c8e-9a7f-%012d", i))
	}
	deadline := time.After(60 * time.Second)
	for range 8 {
		select {
		case <-started:
		case <-deadline:
			t.Fatal("eight clones never ran at once")
		}
	}
	c.fake.ReleaseClones()
	res := c.results(t, 50, 120*time.Second)
	byReplica := map[string]int{}
	pids := map[string]bool{}
	for _, r := range res {
		byReplica[r.GetHandledBy()]++
		if e := r.GetError(); e != nil {
			t.Errorf("%s failed: %v", r.GetCommandId(), e)
			continue
		}
		pid := r.GetCreate().GetInstance().GetProviderId()
		if pids[pid] {
			t.Errorf("providerID %s answered twice", pid)
		}
		pids[pid] = true
	}
	vms := c.fake.VMs()
	if len(vms) != 50 {
		t.Errorf("%d VMs on Proxmox, want 50", len(vms))
	}
	names := map[string]int{}
	for id, v := range vms {
		names[v.Config["name"]]++
		if !pids[fmt.Sprintf("vms/%d/%s", id, v.Config["name"])] {
			t.Errorf("VM %d (%s) is in no result", id, v.Config["name"])
		}
	}
	for n, k := range names {
		if k != 1 {
			t.Errorf("%d VMs named %s", k, n)
		}
	}
	if byReplica["a"] == 0 || byReplica["b"] == 0 {
		t.Errorf("results by replica = %v, want both", byReplica)
	}
	t.Logf("results by replica: %v", byReplica)
	assertNoSecrets(t, c, a, b)
}

// A process killed mid-Create (the clone running) leaves the command to be
// redelivered; the other process waits out the clone's lock, adopts the VM
// and finishes: one VM.
func TestKilledMidCreateIsFinishedByTheOther(t *testing.T) {
	t.Parallel()
	c := newCluster(t)
	c.fake.HoldClones()
	started := c.fake.CloneStarted()
	a := c.start(t, "a", "--ack-wait=2s")
	c.publishCreate(t, "cmd-1", "0f3a6c1e-2b4d-4c8e-9a7f-000000000001")
	var vmid int
	select {
	case vmid = <-started:
	case <-time.After(60 * time.Second):
		t.Fatal("the clone never started")
	}
	b := c.start(t, "b", "--ack-wait=2s")
	a.Kill(t)
	// b takes the redelivered command and finds the VM locked by the clone:
	// it waits on the lock (reading the VM's config) until the clone ends.
	configReads := func() int { return c.fake.Calls()["GET /nodes/{node}/qemu/{vmid}/config"] }
	before := configReads()
	waittest.For(t, 60*time.Second, "b reading the locked VM's config", func() bool { return configReads() > before })
	if v := c.fake.VMs()[vmid]; v.Config["lock"] != "clone" {
		t.Fatalf("VM %d is not locked by its clone: %v", vmid, v.Config)
	}
	c.fake.ReleaseClones()
	res := c.results(t, 1, 60*time.Second)[0]
	if res.GetHandledBy() != "b" || res.GetError() != nil {
		t.Fatalf("result = %v, want b's success", res)
	}
	if got, want := res.GetCreate().GetInstance().GetProviderId(), fmt.Sprintf("vms/%d/proxy-0f3a6c1e-2b4d-4c8e-9a7f-000000000001", vmid); got != want {
		t.Errorf("providerID %s, want %s (the VM a's clone made)", got, want)
	}
	vms := c.fake.VMs()
	if len(vms) != 1 || vms[vmid].Status != "running" {
		t.Errorf("VMs = %v, want VM %d alone, running", vms, vmid)
	}
	b.WaitLog(t, 10*time.Second, func(m map[string]any) bool { return m["msg"] == "proxmox vm adopted" })
	handled := b.WaitLog(t, 10*time.Second, proctest.Msg("command handled"))
	if d, _ := handled["deliveries"].(float64); d < 2 {
		t.Errorf("b handled delivery %v, want a redelivery", handled["deliveries"])
	}
	assertNoSecrets(t, c, a, b)
}

// The same backend over gRPC: CheckBackend for the health service, and the
// error classes as status codes with ErrorInfo.
func TestGRPCOnTheBinary(t *testing.T) {
	t.Parallel()
	c := newCluster(t)
	_, addr, httpAddr := c.startAddr(t, "a")
	dial := func(token string) provisionerv1.ProvisionerServiceClient {
		opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
		if token != "" {
			opts = append(opts, grpc.WithPerRPCCredentials(auth.BearerToken(token)))
		}
		conn, err := grpc.NewClient(addr, opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return provisionerv1.NewProvisionerServiceClient(conn)
	}
	client := dial("svc-token")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Only the suite's services may call a provisioner: no token is
	// UNAUTHENTICATED, an operator's or a crawler's token PERMISSION_DENIED,
	// and none of them reaches the backend.
	before := c.fake.TotalCalls()
	for token, want := range map[string]codes.Code{"": codes.Unauthenticated, "wrong": codes.Unauthenticated,
		"ops-token": codes.PermissionDenied, "crawler-token": codes.PermissionDenied} {
		_, err := dial(token).DeleteInstance(ctx, &provisionerv1.DeleteInstanceRequest{Provider: "pve", Installation: "test", ProviderId: "vms/100/x", ProxyUid: "x"})
		if status.Code(err) != want {
			t.Errorf("DeleteInstance with token %q = %v, want %v", token, err, want)
		}
		if want == codes.PermissionDenied && !strings.Contains(status.Convert(err).Message(), "needs the role service") {
			t.Errorf("the denial does not name the role: %v", err)
		}
	}
	if after := c.fake.TotalCalls(); after != before {
		t.Errorf("refused calls reached Proxmox: %d requests", after-before)
	}
	check, err := client.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: "pve"})
	if err != nil {
		t.Fatal(err)
	}
	if len(check.GetTargets()) != 1 || check.GetTargets()[0].GetReason() != "Reachable" || check.GetTargets()[0].GetDetails()["tokenID"] != tokenUser {
		t.Errorf("check = %v", check)
	}
	created, err := client.CreateInstance(ctx, &provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: "9c9c9c9c-0000-4000-8000-000000000001",
		CloudInit: "#cloud-config\n", Placement: &proxyv1.Placement{MachineType: "small", Image: "debian-13"}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: created.GetInstance().GetProviderId(), ProxyUid: "9c9c9c9c-0000-4000-8000-000000000001"})
	if err != nil || got.GetInstance().GetIp() == "" {
		t.Fatalf("get = %v, %v", got, err)
	}
	_, err = client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: "vms/150000/proxy-gone", ProxyUid: "x"})
	if status.Code(err) != codes.NotFound || errclass.Of(errclass.FromStatus(err)) != errclass.NotFound {
		t.Errorf("get of a missing VM = %v", err)
	}
	_, err = client.CreateInstance(ctx, &provisionerv1.CreateInstanceRequest{Provider: "pve", Installation: "test", ProxyUid: "u", Placement: &proxyv1.Placement{MachineType: "huge", Image: "debian-13"}})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), `placement.machineType "huge" is not in proxmox.machineTypes`) {
		t.Errorf("create with a bad placement = %v", err)
	}
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, want := range []string{
		`egress_provisioner_requests_total{class="none",op="create",provider="pve",result="ok"} 1`,
		`egress_provisioner_requests_total{class="ERROR_REASON_NOT_FOUND",op="get",provider="pve",result="error"} 1`,
		`egress_provisioner_requests_total{class="ERROR_REASON_PERMANENT",op="create",provider="pve",result="error"} 1`,
		`egress_provisioner_request_duration_seconds_count{op="check",provider="pve",result="ok"} 1`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// SIGTERM with a Create in flight: after --drain-timeout the process hands
// the command back (Nak) and exits 0; the other replica finishes it long
// before the ack wait would have redelivered it.
func TestSIGTERMHandsTheInFlightCreateToTheOther(t *testing.T) {
	t.Parallel()
	c := newCluster(t)
	c.fake.HoldClones()
	started := c.fake.CloneStarted()
	a := c.start(t, "a", "--ack-wait=5m", "--drain-timeout=300ms")
	c.publishCreate(t, "cmd-1", "0f3a6c1e-2b4d-4c8e-9a7f-0000000000aa")
	var vmid int
	select {
	case vmid = <-started:
	case <-time.After(60 * time.Second):
		t.Fatal("the clone never started")
	}
	b := c.start(t, "b", "--ack-wait=5m")
	a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Fatalf("exit code %d", code)
	}
	a.WaitLog(t, time.Second, proctest.Msg("handing an unfinished command back for redelivery"))
	configReads := func() int { return c.fake.Calls()["GET /nodes/{node}/qemu/{vmid}/config"] }
	before := configReads()
	waittest.For(t, 60*time.Second, "b waiting on the clone's lock", func() bool { return configReads() > before })
	c.fake.ReleaseClones()
	res := c.results(t, 1, 60*time.Second)[0]
	if res.GetHandledBy() != "b" || res.GetError() != nil || res.GetCreate().GetInstance().GetProviderId() != fmt.Sprintf("vms/%d/proxy-0f3a6c1e-2b4d-4c8e-9a7f-0000000000aa", vmid) {
		t.Fatalf("result = %v", res)
	}
	if n := len(c.fake.VMs()); n != 1 {
		t.Errorf("%d VMs, want 1", n)
	}
	assertNoSecrets(t, c, a, b)
}

// A request that runs out of requestTimeoutSeconds is Transient, and says
// so with its ErrorInfo reason over gRPC and in the NATS result alike.
func TestPerRequestTimeoutCarriesItsReason(t *testing.T) {
	t.Parallel()
	c := newCluster(t)
	f, err := os.OpenFile(c.config, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("      requestTimeoutSeconds: 1\n"); err != nil {
		t.Fatal(err)
	}
	f.Close()
	_, addr, _ := c.startAddr(t, "a")
	// Every answer is held far past the one-second budget.
	c.fake.Inject(pvefake.Fault{Delay: 20 * time.Second})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(auth.BearerToken("svc-token")))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = provisionerv1.NewProvisionerServiceClient(conn).GetInstance(ctx,
		&provisionerv1.GetInstanceRequest{Provider: "pve", Installation: "test", ProviderId: "vms/150000/proxy-slow", ProxyUid: "9c9c9c9c-0000-4000-8000-000000000002"})
	if err == nil {
		t.Fatal("get against a stalled API succeeded")
	}
	var reason string
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == errclass.Domain {
			reason = info.GetReason()
		}
	}
	if reason != errclass.Transient.String() || errclass.Of(errclass.FromStatus(err)) != errclass.Transient {
		t.Errorf("gRPC answer %v carries reason %q, want %s", err, reason, errclass.Transient)
	}

	c.publishCreate(t, "cmd-timeout", "9c9c9c9c-0000-4000-8000-000000000003")
	res := c.results(t, 1, 60*time.Second)[0]
	if res.GetError().GetReason() != errclass.Transient {
		t.Errorf("NATS result %v, want reason %s", res.GetError(), errclass.Transient)
	}
}
