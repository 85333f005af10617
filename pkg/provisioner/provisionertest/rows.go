package provisionertest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/crashpoint"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
)

var errNotYet = errors.New("not yet")

// createTwice: a repeated Create answers the same instance, and the
// backend holds one.
func createTwice(t *testing.T, s *Suite) {
	uid := s.uid(t)
	first := s.create(t, uid)
	after := s.observe(t, uid)
	if len(after.Instances) != 1 {
		t.Fatalf("after one Create the backend holds %v, want one instance", after.Instances)
	}
	again := s.create(t, uid)
	sameInstance(t, "the second Create", first, again)
	if got := s.observe(t, uid); !got.equal(after) {
		t.Errorf("after the second Create the backend holds %+v, after the first %+v", got, after)
	}
}

// sameInstance fails unless b is a's instance, as a's answer named it.
func sameInstance(t *testing.T, what string, a, b *provisionerv1.Instance) {
	t.Helper()
	if b.GetProviderId() != a.GetProviderId() || b.GetName() != a.GetName() || b.GetProxyUid() != a.GetProxyUid() {
		t.Errorf("%s answered %s (%s, UID %s), want %s (%s, UID %s)", what, b.GetProviderId(), b.GetName(), b.GetProxyUid(),
			a.GetProviderId(), a.GetName(), a.GetProxyUid())
	}
	if a.GetCreateTime() != nil && !b.GetCreateTime().AsTime().Equal(a.GetCreateTime().AsTime()) {
		t.Errorf("%s answered creation time %v, want %v (the mark's)", what, b.GetCreateTime().AsTime(), a.GetCreateTime().AsTime())
	}
}

// halfMade: what an interrupted Create left is adopted and finished, not
// made a second time.
func halfMade(t *testing.T, s *Suite) {
	if s.tr.HalfMade == nil {
		t.Skip("the Tester declares no HalfMade")
	}
	uid := s.uid(t)
	pid := s.tr.HalfMade(t, uid)
	before := s.observe(t, uid)
	if len(before.Instances) != 1 {
		t.Fatalf("HalfMade left %v, want one instance", before.Instances)
	}
	in := s.create(t, uid)
	if in.GetProviderId() != pid {
		t.Errorf("Create answered %s, want the half-made %s adopted", in.GetProviderId(), pid)
	}
	if got := s.observe(t, uid); len(got.Instances) != 1 {
		t.Errorf("after adopting, the backend holds %v, want one instance", got.Instances)
	}
	sameInstance(t, "a Create after the adoption", in, s.create(t, uid))
}

// crashes: the process killed at each step of Create; the next Create
// finishes what it left, and the backend then holds what an uninterrupted
// Create leaves.
func crashes(t *testing.T, s *Suite) {
	if len(s.tr.CrashSteps) == 0 {
		t.Skip("the Tester declares no CrashSteps")
	}
	for _, step := range s.tr.CrashSteps {
		t.Run(step.Name, func(t *testing.T) {
			t.Parallel()
			crashAt(t, s, step)
		})
	}
}

func crashAt(t *testing.T, s *Suite, step CrashStep) {
	want := s.reference(t)
	uid := s.uid(t)
	p := s.start(t, s.tr.Backend(t), crashpoint.Env+"="+step.Name)
	ctx := ctxFor(t)
	reached := func() bool {
		for _, l := range p.Logs() {
			if l["msg"] == crashpoint.Msg && l["step"] == step.Name {
				return true
			}
		}
		return false
	}
	done := make(chan error, 1)
	go func() {
		for {
			_, err := p.Client.CreateInstance(ctx, s.request(uid))
			// A Transient answer before the crash point is retried, as
			// the orchestrator retries it.
			if err == nil || ctx.Err() != nil || reached() || errclass.Of(errclass.FromStatus(err)) != errclass.Transient {
				done <- err
				return
			}
			t.Logf("Create before the crash point %s answered Transient, retried: %v", step.Name, err)
		}
	}()
	waittest.ForErr(t, Patience, "the crash point "+step.Name, func() error {
		if reached() {
			return nil
		}
		select {
		case err := <-done:
			t.Fatalf("Create ended before the crash point %s: %v", step.Name, err)
		default:
		}
		return errNotYet
	})
	if step.Until != nil {
		waittest.ForErr(t, Patience, "the backend at "+step.Name, func() error { return step.Until(t, uid) })
	}
	p.Kill(t)
	if err := <-done; err == nil {
		t.Fatal("the Create of the killed process succeeded")
	}
	t.Logf("the crash at %s left %+v", step.Name, s.observe(t, uid))
	in := s.create(t, uid)
	var got Observed
	if err := waittest.Until(Patience, func() error {
		if got = s.observe(t, uid); !got.equal(want) {
			return errNotYet
		}
		return nil
	}); err != nil {
		t.Fatalf("after the crash at %s and the next Create the backend holds %+v, an uninterrupted Create %+v", step.Name, got, want)
	}
	get, err := s.main.Client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: in.GetProviderId(), ProxyUid: uid})
	if err != nil {
		t.Fatalf("Get after the recovery: %v", err)
	}
	assertLive(t, "Get after the recovery", get.GetInstance())
}

// foreign: an instance with our name but not our mark is refused
// Permanent by Create, is NotFound to Get, is left by Delete and List, and
// is left as it was.
func foreign(t *testing.T, s *Suite) {
	if s.tr.Foreign == nil {
		t.Skip("the Tester declares no Foreign")
	}
	uid := s.uid(t)
	f := s.tr.Foreign(t, uid)
	ctx := ctxFor(t)
	_, err := s.main.Client.CreateInstance(ctx, s.request(uid))
	assertClass(t, "Create over the foreign instance", err, errclass.Permanent)
	_, err = s.main.Client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: f.ProviderID, ProxyUid: uid})
	assertClass(t, "Get of the foreign instance", err, errclass.NotFound)
	del, err := s.main.Client.DeleteInstance(ctx, &provisionerv1.DeleteInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: f.ProviderID, ProxyUid: uid})
	if err != nil || del.GetDeleted() {
		t.Errorf("Delete of the foreign instance = %v, %v; want deleted false and no error", del, err)
	}
	if err := f.Unchanged(); err != nil {
		t.Errorf("the foreign instance was touched: %v", err)
	}
	if got := s.observe(t, uid); len(got.Instances) != 1 {
		t.Errorf("the backend holds %v, want the foreign instance alone", got.Instances)
	}
}

// deleteTwice: Delete, and Delete again, succeed; nothing of the proxy is
// left; a Delete then says there was nothing.
func deleteTwice(t *testing.T, s *Suite) {
	uid := s.uid(t)
	in := s.create(t, uid)
	ctx := ctxFor(t)
	req := &provisionerv1.DeleteInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: in.GetProviderId(), ProxyUid: uid}
	first, err := s.main.Client.DeleteInstance(ctx, req)
	if err != nil || !first.GetDeleted() {
		t.Fatalf("Delete = %v, %v; want deleted", first, err)
	}
	if _, err := s.main.Client.DeleteInstance(ctx, req); err != nil {
		t.Fatalf("the second Delete: %v", err)
	}
	var left Observed
	if err := waittest.Until(Patience, func() error {
		if left = s.observe(t, uid); !left.empty() {
			return errNotYet
		}
		return nil
	}); err != nil {
		t.Fatalf("after Delete the backend still holds %+v", left)
	}
	last, err := s.main.Client.DeleteInstance(ctx, req)
	if err != nil || last.GetDeleted() {
		t.Errorf("Delete of a gone instance = %v, %v; want deleted false and no error", last, err)
	}
}

// getAfterDelete: once deleted, Get answers DELETING at most, then
// NotFound, with its reason over gRPC.
func getAfterDelete(t *testing.T, s *Suite) {
	uid := s.uid(t)
	in := s.create(t, uid)
	ctx := ctxFor(t)
	if _, err := s.main.Client.DeleteInstance(ctx, &provisionerv1.DeleteInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: in.GetProviderId(), ProxyUid: uid}); err != nil {
		t.Fatal(err)
	}
	var err error
	waittest.For(t, Patience, "Get to answer an error after Delete", func() bool {
		var got *provisionerv1.GetInstanceResponse
		got, err = s.main.Client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: in.GetProviderId(), ProxyUid: uid})
		if err == nil && got.GetInstance().GetState() != provisionerv1.InstanceState_INSTANCE_STATE_DELETING {
			t.Fatalf("Get after Delete answered %s, want DELETING or NotFound", got.GetInstance().GetState())
		}
		return err != nil
	})
	assertClass(t, "Get after Delete", err, errclass.NotFound)
}

// listOursOnly: List answers our instance as Create did, and nothing that
// is not ours.
func listOursOnly(t *testing.T, s *Suite) {
	uid := s.uid(t)
	in := s.create(t, uid)
	var f Foreign
	var foreignUID string
	if s.tr.Foreign != nil {
		foreignUID = s.uid(t)
		f = s.tr.Foreign(t, foreignUID)
	}
	list, err := s.main.Client.ListInstances(ctxFor(t), &provisionerv1.ListInstancesRequest{Provider: ProviderName, Installation: Installation})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, l := range list.GetInstances() {
		if l.GetProxyUid() == "" || l.GetProviderId() == "" || l.GetName() == "" {
			t.Errorf("List answered %v: every instance has its proxy UID, providerID and name", l)
		}
		if l.GetProviderId() == in.GetProviderId() {
			found = true
			sameInstance(t, "List", in, l)
			if l.GetCreateTime() == nil {
				t.Errorf("List answered %s without its creation time (orphan GC spares young instances by it)", l.GetProviderId())
			}
		}
		if foreignUID != "" && (l.GetProviderId() == f.ProviderID || strings.Contains(l.GetName(), foreignUID)) {
			t.Errorf("List answered the foreign instance %v", l)
		}
	}
	if !found {
		t.Errorf("List lacks %s: %v", in.GetProviderId(), list.GetInstances())
	}
}

// unreachable: with the backend cut off, Create and List are Transient
// with their reason over gRPC, and Check answers a verdict: not ready,
// with a declared reason.
func unreachable(t *testing.T, s *Suite) {
	if s.tr.Unreachable == nil {
		t.Skip("the Tester declares no Unreachable")
	}
	o := s.tr.Unreachable(t)
	p := s.start(t, o.Backend)
	if o.Cut != nil {
		o.Cut()
	}
	ctx := ctxFor(t)
	uid := s.uid(t)
	_, err := p.Client.CreateInstance(ctx, s.request(uid))
	assertClass(t, "Create on an unreachable backend", err, errclass.Transient)
	_, err = p.Client.ListInstances(ctx, &provisionerv1.ListInstancesRequest{Provider: ProviderName, Installation: Installation})
	assertClass(t, "List on an unreachable backend", err, errclass.Transient)
	resp, err := p.Client.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: ProviderName})
	if err != nil {
		t.Fatalf("CheckBackend on an unreachable backend: %v; want a verdict", err)
	}
	assertVerdict(t, resp, func(ts *provisionerv1.TargetStatus) error {
		if ts.GetReady() || ts.GetReason() == provisioner.ReasonReachable {
			return errors.New("ready on an unreachable backend")
		}
		return nil
	})
}

// quota: a Create the backend refuses for quota is QuotaExceeded with its
// reason over gRPC, and leaves nothing.
func quota(t *testing.T, s *Suite) {
	if s.tr.Quota == nil {
		t.Skip("the Tester declares no Quota: the backend has no quota it reports")
	}
	q := s.tr.Quota(t)
	p := s.start(t, q.Backend)
	uid := s.uid(t)
	req := s.request(uid)
	req.Placement = q.Placement
	_, err := p.Client.CreateInstance(ctxFor(t), req)
	assertClass(t, "Create beyond the quota", err, errclass.QuotaExceeded)
	if got := s.observe(t, uid); len(got.Instances) != 0 {
		t.Errorf("a Create refused for quota left %v", got.Instances)
	}
}

// checkVerdict: the healthy backend's check answers every target ready,
// Reachable.
func checkVerdict(t *testing.T, s *Suite) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resp, err := s.main.Client.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: ProviderName})
	if err != nil {
		t.Fatalf("CheckBackend: %v", err)
	}
	assertVerdict(t, resp, func(ts *provisionerv1.TargetStatus) error {
		if !ts.GetReady() || ts.GetReason() != provisioner.ReasonReachable {
			return errors.New("the healthy backend is not ready and Reachable")
		}
		return nil
	})
}

// shortDeadline is the caller's deadline of checkShortDeadline: far below
// every backend's own check timeout.
const shortDeadline = 2 * time.Second

// checkShortDeadline: a check whose backend does not answer still answers
// the caller a verdict, not ready, Timeout, before the caller's deadline.
func checkShortDeadline(t *testing.T, s *Suite) {
	p, stalled := s.main, s.tr.Stalled != nil
	if stalled {
		p = s.start(t, s.tr.Stalled(t))
	}
	ctx, cancel := context.WithTimeout(context.Background(), shortDeadline)
	defer cancel()
	start := time.Now()
	resp, err := p.Client.CheckBackend(ctx, &provisionerv1.CheckBackendRequest{Provider: ProviderName})
	if err != nil {
		t.Fatalf("CheckBackend with a %s deadline answered %v after %s; want a verdict", shortDeadline, err, time.Since(start))
	}
	assertVerdict(t, resp, func(ts *provisionerv1.TargetStatus) error {
		if stalled && (ts.GetReady() || ts.GetReason() != provisioner.ReasonTimeout) {
			return errors.New("a backend that never answers is not Timeout")
		}
		return nil
	})
	if !stalled {
		t.Logf("the Tester declares no Stalled: the healthy backend answered within %s", shortDeadline)
	}
}

// assertVerdict checks every target of a check's answer: a name, a
// declared reason, a latency, a message within bounds, and want.
func assertVerdict(t *testing.T, resp *provisionerv1.CheckBackendResponse, want func(*provisionerv1.TargetStatus) error) {
	t.Helper()
	if len(resp.GetTargets()) == 0 {
		t.Fatal("CheckBackend answered no target")
	}
	for _, ts := range resp.GetTargets() {
		var problems []string
		if ts.GetName() == "" {
			problems = append(problems, "no name")
		}
		if !provisioner.IsCheckReason(ts.GetReason()) {
			problems = append(problems, fmt.Sprintf("reason %q is not one of provisioner.CheckReasons", ts.GetReason()))
		}
		if ts.GetLatency() == nil {
			problems = append(problems, "no latency")
		}
		if len([]rune(ts.GetMessage())) > provisioner.MaxCheckMessage {
			problems = append(problems, "a message longer than provisioner.MaxCheckMessage")
		}
		if err := want(ts); err != nil {
			problems = append(problems, err.Error())
		}
		if len(problems) > 0 {
			t.Errorf("target %v: %s", ts, strings.Join(problems, "; "))
		}
	}
}

// codes of the classes over gRPC (docs/provisioner-runtime.md).
var classCodes = map[errclass.Class]codes.Code{
	errclass.NotFound: codes.NotFound, errclass.Permanent: codes.FailedPrecondition,
	errclass.Transient: codes.Unavailable, errclass.QuotaExceeded: codes.ResourceExhausted,
}

// assertClass checks that err reached the client as class: its gRPC code,
// an ErrorInfo of the provisioner domain whose reason is the class, a
// message, and errclass reading the class back.
func assertClass(t *testing.T, what string, err error, class errclass.Class) {
	t.Helper()
	if err == nil {
		t.Errorf("%s succeeded; want %s", what, class)
		return
	}
	st := status.Convert(err)
	reason := ""
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == errclass.Domain {
			reason = info.GetReason()
		}
	}
	if st.Code() != classCodes[class] || reason != class.String() || st.Message() == "" || errclass.Of(errclass.FromStatus(err)) != class {
		t.Errorf("%s answered %s %q with reason %q; want %s with reason %s", what, st.Code(), st.Message(), reason, classCodes[class], class)
	}
}

// noSecretInLogs: the cloud-init of every Create, and the credentials
// row's password, reached no provisioner's log.
func noSecretInLogs(t *testing.T, s *Suite) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, p := range s.procs {
		if strings.Contains(p.Output(), s.secret) {
			t.Errorf("the cloud-init reached the log of provisioner %d", i)
		}
		if strings.Contains(p.Output(), s.password) {
			t.Errorf("a proxy's password reached the log of provisioner %d", i)
		}
	}
}

// createWithCredentials creates uid's instance demanding c, retrying
// Transient answers.
func createWithCredentials(t *testing.T, s *Suite, uid string, c *proxyv1.ProxyCredentials) *provisionerv1.Instance {
	t.Helper()
	ctx := ctxFor(t)
	req := s.request(uid)
	req.Credentials = c
	resp, err := s.main.Client.CreateInstance(ctx, req)
	for err != nil && ctx.Err() == nil && errclass.Of(errclass.FromStatus(err)) == errclass.Transient {
		time.Sleep(200 * time.Millisecond)
		resp, err = s.main.Client.CreateInstance(ctx, req)
	}
	if err != nil {
		t.Fatalf("Create %s with credentials: %v", uid, err)
	}
	assertLive(t, "Create", resp.GetInstance())
	return resp.GetInstance()
}

// credentialsUpdated: UpdateCredentials either makes the same instance
// demand the new credentials and refuse the old ones (a backend that
// declares CredentialsInPlace), or answers Unsupported and changes nothing,
// so that the orchestrator replaces the instance. Either way the backend
// still holds one instance of the proxy.
func credentialsUpdated(t *testing.T, s *Suite) {
	if s.tr.Credentials == nil {
		t.Skip("the Tester declares no Credentials")
	}
	uid := s.uid(t)
	updated := &proxyv1.ProxyCredentials{Username: "egress-" + randomHex(6), Password: s.password + "-rotated"}
	if !s.tr.CredentialsInPlace {
		// Answered before the backend is asked, so no instance is needed
		// (the backends that refuse are the VM ones, slow to create).
		_, err := s.main.Client.UpdateCredentials(ctxFor(t), &provisionerv1.UpdateCredentialsRequest{
			Provider: ProviderName, Installation: Installation, ProviderId: "no-instance/" + uid, ProxyUid: uid, Credentials: updated,
		})
		if errclass.Of(errclass.FromStatus(err)) != errclass.Unsupported || status.Code(err) != codes.Unimplemented {
			t.Fatalf("UpdateCredentials on a backend that does not declare CredentialsInPlace: %v, want UNIMPLEMENTED with reason Unsupported", err)
		}
		if o := s.tr.Observe(t, uid); !o.empty() {
			t.Errorf("the refused update left %v on the backend", o)
		}
		return
	}
	old := &proxyv1.ProxyCredentials{Username: "egress-" + randomHex(6), Password: s.password}
	in := createWithCredentials(t, s, uid, old)
	before := s.tr.Observe(t, uid)
	resp, err := s.main.Client.UpdateCredentials(ctxFor(t), &provisionerv1.UpdateCredentialsRequest{
		Provider: ProviderName, Installation: Installation, ProviderId: in.GetProviderId(), ProxyUid: uid, Credentials: updated,
	})
	if err != nil {
		t.Fatalf("UpdateCredentials: %v", err)
	}
	if got := resp.GetInstance().GetProviderId(); got != in.GetProviderId() {
		t.Errorf("UpdateCredentials answered instance %q, want the same instance %q", got, in.GetProviderId())
	}
	if err := s.tr.Credentials(t, uid, updated); err != nil {
		t.Errorf("the instance does not demand the new credentials: %v", err)
	}
	if err := s.tr.Credentials(t, uid, old); err == nil {
		t.Error("the instance still admits the old credentials")
	}
	if after := s.tr.Observe(t, uid); !after.normal(uid).equal(before.normal(uid)) || len(after.Instances) != 1 {
		t.Errorf("the backend holds %v after the update, want what it held before: %v", after, before)
	}
}

// credentialsDelivered: a Create carrying the proxy's credentials (as the
// runtime hands a backend those it fetched from the orchestrator) gives
// them to the instance, and only them: the Tester finds those, and not
// others of the same user.
func credentialsDelivered(t *testing.T, s *Suite) {
	if s.tr.Credentials == nil {
		t.Skip("the Tester declares no Credentials")
	}
	uid := s.uid(t)
	creds := &proxyv1.ProxyCredentials{Username: "egress-" + randomHex(6), Password: s.password}
	createWithCredentials(t, s, uid, creds)
	if err := s.tr.Credentials(t, uid, creds); err != nil {
		t.Errorf("the instance did not receive the proxy's credentials: %v", err)
	}
	other := &proxyv1.ProxyCredentials{Username: creds.GetUsername(), Password: s.password + "-other"}
	if err := s.tr.Credentials(t, uid, other); err == nil {
		t.Errorf("the Tester finds other credentials on the instance too: its check proves nothing")
	}
}
