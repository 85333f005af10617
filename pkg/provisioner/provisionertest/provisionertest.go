// Package provisionertest is the Provisioner contract as a conformance
// suite: TestAll runs every row of the contract (docs/provisioner-runtime.md)
// against one backend, which each backend's tests call with a Tester of
// their own: proxmox and gcp over their fakes, kvm over the real libvirtd,
// kubernetes over a real API server, local for real.
//
// The suite talks to real provisioner processes over gRPC, as the health
// service and an operator do: the backend's binary, built with the
// crashpoints tag (pkg/provisioner/crashpoint), serving a providers file
// the Tester writes the backend's block of. It reads the backend's truth
// through the Tester (Observe), never through the provisioner, so "one
// instance" means one on the backend. Every row starts from fresh proxy
// UIDs, so the rows run in parallel against one backend.
//
// A Tester declares what its backend can be made to do with function
// fields: how to leave a half-made instance, how to place a foreign one,
// which steps of Create a crash can be injected at, how to make the
// backend unreachable, hung or out of quota. A row needing a capability
// the Tester lacks skips, saying so, and docs/provisioner-runtime.md's
// feature matrix lists who declares what.
//
// Adding a row: write func(t *testing.T, s *Suite), add it to rows with
// its name (the name the contract table cites), and, when it needs the
// backend to do something new, a field to Tester that backends fill in.
package provisionertest

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// ProviderName is the provider name the suite's provisioners serve.
const ProviderName = "conformance"

// Installation is the installation every request of the suite names but
// those of the installations rows, which name OtherInstallation too: two
// installations sharing one backend.
const (
	Installation      = "conformance"
	OtherInstallation = "conformance-other"
)

// Tester is one backend's harness for the suite.
type Tester struct {
	// Binary is the backend's provisioner binary.
	Binary Binary
	// Type is the backend's provider type.
	Type string
	// Backend returns the backend block (Provider.Block) of a provider on
	// the healthy backend.
	Backend func(t *testing.T) string
	// Placement is what every Create asks for (nil: none).
	Placement *proxyv1.Placement

	// Observe reads what the backend holds for the proxy uid, without the
	// provisioner.
	Observe func(t *testing.T, uid string) Observed
	// Remove, when set, removes whatever of uid the backend still holds
	// after a row (behind the suite's own Delete), for a backend shared
	// beyond the test.
	Remove func(t *testing.T, uid string)

	// HalfMade puts on the backend what an interrupted Create of uid
	// leaves there, marked as ours, and returns its providerID.
	HalfMade func(t *testing.T, uid string) string
	// Foreign puts on the backend an instance with the name uid's instance
	// gets but without our mark.
	Foreign func(t *testing.T, uid string) Foreign
	// Unclaim rewrites the mark of uid's instance as it was before marks
	// named an installation: ours, uid's, without the installation.
	Unclaim func(t *testing.T, uid string)
	// CrashSteps are the crash points of the backend's Create
	// (crashpoint.After and During) that the suite's Create reaches, in
	// order.
	CrashSteps []CrashStep
	// Unreachable is the backend cut off from the provisioner.
	Unreachable func(t *testing.T) Outage
	// Stalled returns a backend block whose backend accepts connections
	// and never answers (StalledAddress).
	Stalled func(t *testing.T) string
	// Quota is a Create the backend refuses for want of quota.
	Quota func(t *testing.T) Quota
	// Credentials reports whether uid's instance received c by the
	// backend's own means (a seed's meta-data, instance metadata, a
	// Secret or htpasswd file that admits them): nil when it did, an
	// error saying what the instance holds when it did not.
	Credentials func(t *testing.T, uid string, c *proxyv1.ProxyCredentials) error
	// CredentialsInPlace declares that the backend implements
	// UpdateCredentials; the others must answer it Unsupported.
	CredentialsInPlace bool
}

// Observed is what a backend holds for one proxy. Every entry names a
// thing and may carry its state, and no per-instance value but the proxy
// UID, which the suite replaces before comparing two proxies' entries
// ("vm proxy-<uid> running").
type Observed struct {
	// Instances are the proxy's instances (VMs, domains, pods, records).
	Instances []string
	// Parts are the rest made for it (disks, seed images, processes).
	Parts []string
}

func (o Observed) empty() bool { return len(o.Instances) == 0 && len(o.Parts) == 0 }

// normal is o with uid replaced and each list sorted.
func (o Observed) normal(uid string) Observed {
	f := func(in []string) []string {
		out := make([]string, len(in))
		for i, s := range in {
			out[i] = strings.ReplaceAll(s, uid, "<uid>")
		}
		slices.Sort(out)
		return out
	}
	return Observed{Instances: f(o.Instances), Parts: f(o.Parts)}
}

func (o Observed) equal(p Observed) bool {
	return slices.Equal(o.Instances, p.Instances) && slices.Equal(o.Parts, p.Parts)
}

// Foreign is an instance that is not ours.
type Foreign struct {
	// ProviderID is the one Get and Delete are asked about.
	ProviderID string
	// Unchanged reports how the instance differs from what was made, nil
	// when it does not.
	Unchanged func() error
}

// CrashStep is a point of Create where the suite kills the process.
type CrashStep struct {
	// Name is the step's crash point.
	Name string
	// Until, when set, must hold before the kill (a During step's work
	// under way on the backend).
	Until func(t *testing.T, uid string) error
}

// Outage is a backend the provisioner cannot reach.
type Outage struct {
	// Backend is the backend block to serve.
	Backend string
	// Cut, when set, cuts the backend off once the provisioner runs (a
	// backend that cannot be unreachable from the start).
	Cut func()
}

// Quota is a Create refused for quota.
type Quota struct {
	// Backend is the backend block to serve.
	Backend string
	// Placement is the Create's.
	Placement *proxyv1.Placement
}

// Patience bounds every wait of the suite: a Create, a state to come, a
// crash point to be reached.
const Patience = 3 * time.Minute

// Suite is one run of the suite against one backend.
type Suite struct {
	tr Tester
	// main serves the healthy backend for every row.
	main *Provisioner
	// secret is in every Create's cloud-init and must reach no log.
	secret string
	// password is the credentials row's, which must reach no log either.
	password string

	mu    sync.Mutex
	procs []*Provisioner

	refOnce sync.Once
	ref     Observed
	refErr  string
}

// rows are the contract, in the order of the table in
// docs/provisioner-runtime.md.
var rows = []struct {
	name string
	run  func(*testing.T, *Suite)
}{
	{"CreateTwiceGivesOneInstance", createTwice},
	{"HalfMadeInstanceIsAdopted", halfMade},
	{"CrashAtEveryStepIsRecovered", crashes},
	{"ForeignInstanceIsRefusedAndLeftAlone", foreign},
	{"DeleteTwiceSucceeds", deleteTwice},
	{"GetAfterDeleteIsNotFound", getAfterDelete},
	{"ListAnswersOursOnly", listOursOnly},
	{"InstallationsLeaveEachOthersInstancesAlone", installations},
	{"LegacyMarkIsClaimedByItsProxy", legacyClaimed},
	{"UnreachableBackendIsTransient", unreachable},
	{"QuotaExceededIsReported", quota},
	{"CheckAnswersAVerdict", checkVerdict},
	{"CheckAnswersWithinAShortDeadline", checkShortDeadline},
	{"CredentialsReachTheInstance", credentialsDelivered},
	{"CredentialsChangeInPlaceOrUnsupported", credentialsUpdated},
}

// TestAll runs the contract against tr's backend: the rows in parallel,
// then the checks over every process's log.
func TestAll(t *testing.T, tr Tester) {
	for _, need := range []struct {
		what string
		ok   bool
	}{{"Binary.Package", tr.Binary.Package != ""}, {"Type", tr.Type != ""}, {"Backend", tr.Backend != nil}, {"Observe", tr.Observe != nil}} {
		if !need.ok {
			t.Fatalf("provisionertest: the Tester lacks %s", need.what)
		}
	}
	s := &Suite{tr: tr, secret: "conformance-secret-" + randomHex(8), password: "conformance-password-" + randomHex(8)}
	s.main = s.start(t, tr.Backend(t))
	t.Run("rows", func(t *testing.T) {
		for _, r := range rows {
			t.Run(r.name, func(t *testing.T) {
				t.Parallel()
				r.run(t, s)
			})
		}
	})
	t.Run("NoSecretInLogs", func(t *testing.T) { noSecretInLogs(t, s) })
}

// start runs a provisioner of the suite's binary serving block.
func (s *Suite) start(t *testing.T, block string, env ...string) *Provisioner {
	t.Helper()
	p := s.tr.Binary.Start(t, Provider{Name: ProviderName, Type: s.tr.Type, Block: block}, StartOptions{Tags: []string{"crashpoints"}, Env: env})
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	return p
}

// uid is a fresh proxy UID, removed from the backend after the test.
func (s *Suite) uid(t *testing.T) string {
	uid := uuid.NewString()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), Patience)
		defer cancel()
		s.cleanup(ctx, t, uid)
	})
	return uid
}

// cleanup deletes what uid has through the provisioner, then the Tester's
// Remove takes what is left.
func (s *Suite) cleanup(ctx context.Context, t *testing.T, uid string) {
	if s.tr.Remove != nil {
		defer s.tr.Remove(t, uid)
	}
	for _, inst := range []string{Installation, OtherInstallation} {
		list, err := s.main.Client.ListInstances(ctx, &provisionerv1.ListInstancesRequest{Provider: ProviderName, Installation: inst})
		if err != nil {
			return
		}
		for _, in := range list.GetInstances() {
			if in.GetProxyUid() == uid {
				_, _ = s.main.Client.DeleteInstance(ctx, &provisionerv1.DeleteInstanceRequest{Provider: ProviderName, Installation: inst, ProviderId: in.GetProviderId(), ProxyUid: uid})
			}
		}
	}
}

// request is the suite's Create of uid.
func (s *Suite) request(uid string) *provisionerv1.CreateInstanceRequest {
	return &provisionerv1.CreateInstanceRequest{
		Provider: ProviderName, Installation: Installation, ProxyUid: uid, ProxyName: "conformance", Port: 3128, SpecHash: "conformance",
		Placement: s.tr.Placement,
		CloudInit: "#cloud-config\n# " + s.secret + "\n",
	}
}

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), Patience)
	t.Cleanup(cancel)
	return ctx
}

// create creates uid's instance through the main provisioner.
func (s *Suite) create(t *testing.T, uid string) *provisionerv1.Instance {
	t.Helper()
	return s.createFor(t, uid, Installation)
}

// createFor creates uid's instance for installation.
func (s *Suite) createFor(t *testing.T, uid, installation string) *provisionerv1.Instance {
	t.Helper()
	ctx := ctxFor(t)
	req := s.request(uid)
	req.Installation = installation
	resp, err := s.main.Client.CreateInstance(ctx, req)
	// Transient means "retry", and the orchestrator does: so does the
	// suite, within its patience.
	for err != nil && ctx.Err() == nil && errclass.Of(errclass.FromStatus(err)) == errclass.Transient {
		t.Logf("Create %s answered Transient, retried: %v", uid, err)
		time.Sleep(200 * time.Millisecond)
		resp, err = s.main.Client.CreateInstance(ctx, req)
	}
	if err != nil {
		t.Fatalf("Create %s: %v", uid, err)
	}
	in := resp.GetInstance()
	assertLive(t, "Create", in)
	if in.GetProxyUid() != uid || in.GetProviderId() == "" || in.GetName() == "" {
		t.Fatalf("Create %s answered %v: want its proxy UID, a providerID and a name", uid, in)
	}
	return in
}

// observe is the Tester's Observe, normalised.
func (s *Suite) observe(t *testing.T, uid string) Observed {
	t.Helper()
	return s.tr.Observe(t, uid).normal(uid)
}

// reference is what a Create left uninterrupted leaves on the backend,
// normalised: what every recovered Create must leave too.
func (s *Suite) reference(t *testing.T) Observed {
	t.Helper()
	s.refOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), Patience)
		defer cancel()
		uid := uuid.NewString()
		resp, err := s.main.Client.CreateInstance(ctx, s.request(uid))
		if err != nil {
			s.refErr = "the reference Create failed: " + err.Error()
			return
		}
		s.ref = s.observe(t, uid)
		_, _ = s.main.Client.DeleteInstance(ctx, &provisionerv1.DeleteInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: resp.GetInstance().GetProviderId(), ProxyUid: uid})
		if s.tr.Remove != nil {
			s.tr.Remove(t, uid)
		}
	})
	if s.refErr != "" {
		t.Fatal(s.refErr)
	}
	return s.ref
}

// live states are those of an instance that exists and is, or is
// becoming, a running proxy.
func live(st provisionerv1.InstanceState) bool {
	return st == provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || st == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING
}

func assertLive(t *testing.T, what string, in *provisionerv1.Instance) {
	t.Helper()
	if !live(in.GetState()) {
		t.Fatalf("%s answered %s for %s (%v); an instance created or adopted is PROVISIONING or RUNNING", what, in.GetState(), in.GetProviderId(), in.GetDetails())
	}
}
