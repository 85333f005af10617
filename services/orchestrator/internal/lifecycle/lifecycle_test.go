package lifecycle

import (
	"io"
	"log/slog"
	"time"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// The helpers every table of this package builds its proxies and results
// with.

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

const (
	pending      = proxyv1.ProxyPhase_PROXY_PHASE_PENDING
	provisioning = proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING
	running      = proxyv1.ProxyPhase_PROXY_PHASE_RUNNING
	ready        = proxyv1.ProxyPhase_PROXY_PHASE_READY
	failed       = proxyv1.ProxyPhase_PROXY_PHASE_FAILED
	deletingP    = proxyv1.ProxyPhase_PROXY_PHASE_DELETING

	opNone   = busv1.Operation_OPERATION_UNSPECIFIED
	opCreate = busv1.Operation_OPERATION_CREATE
	opGet    = busv1.Operation_OPERATION_GET
	opDelete = busv1.Operation_OPERATION_DELETE
	opUpdate = busv1.Operation_OPERATION_UPDATE_CREDENTIALS
)

// machine is the production schedule without jitter; provider "pve" is
// configured.
func machine() *Machine {
	return &Machine{
		Timing:     DefaultTiming(),
		Configured: func(p string) bool { return p == "pve" },
		Log:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		NoJitter:   true,
	}
}

type opt func(*Proxy)

// proxy is a managed proxy of provider pve with no instance, PENDING.
func proxy(opts ...opt) *Proxy {
	p := &Proxy{
		UID: "u1", Name: "p1", Generation: 1, SpecHash: "h1",
		Spec:  &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128},
		Phase: pending, Port: 3128,
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func withInstance(p *Proxy) {
	p.ProviderID, p.InstanceSpecHash, p.IP = "vms/101/proxy-u1", "h1", "10.0.0.9"
	p.Phase, p.Reason = running, ReasonRunning
}
func healthy(p *Proxy)     { p.Healthy, p.Phase, p.Reason = true, ready, ReasonHealthy }
func deleting(p *Proxy)    { p.DeleteTime, p.Reason = &t0, ReasonDeleting }
func skipCleanup(p *Proxy) { p.SkipCleanup = true }
func stoppedSince(t time.Time) opt {
	return func(p *Proxy) { p.StoppedSince = &t }
}
func provider(name string) opt { return func(p *Proxy) { p.Spec.Provider = name } }
func external(p *Proxy) {
	p.Spec = &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "h", Port: 1}}
	p.SpecHash, p.Phase, p.Reason = "", running, ReasonExternal
}
func failedLatch(p *Proxy) {
	p.Phase, p.FailedSpecHash, p.Reason = failed, "h1", ReasonProviderError
}
func specChanged(p *Proxy) { p.SpecHash, p.Generation = "h2", 2 }
func attempts(n int32) opt { return func(p *Proxy) { p.Attempts = n } }
func reason(r Reason) opt  { return func(p *Proxy) { p.Reason = r } }
func step(s Step) opt      { return func(p *Proxy) { p.CommandStep = s } }
func inFlight(s Step, deadline time.Time) opt {
	return func(p *Proxy) { p.CommandID, p.CommandStep, p.CommandDeadline = "c-old", s, &deadline }
}
func traced(p *Proxy) { p.TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" }

// result answers cmd: with err, or with inst for a Create, Get or
// UpdateCredentials.
func result(cmd *busv1.Command, err error, inst *provisionerv1.Instance) *busv1.CommandResult {
	res := &busv1.CommandResult{CommandId: cmd.GetCommandId(), SpecHash: cmd.GetSpecHash(), Operation: cmd.GetOperation()}
	switch {
	case err != nil:
		res.Outcome = &busv1.CommandResult_Error{Error: errclass.ToCommandError(err)}
	case cmd.GetOperation() == opCreate:
		res.Outcome = &busv1.CommandResult_Create{Create: &provisionerv1.CreateInstanceResponse{Instance: inst}}
	case cmd.GetOperation() == opGet:
		res.Outcome = &busv1.CommandResult_Get{Get: &provisionerv1.GetInstanceResponse{Instance: inst}}
	case cmd.GetOperation() == opUpdate:
		res.Outcome = &busv1.CommandResult_UpdateCredentials{UpdateCredentials: &provisionerv1.UpdateCredentialsResponse{Instance: inst}}
	default:
		res.Outcome = &busv1.CommandResult_Delete{Delete: &provisionerv1.DeleteInstanceResponse{Deleted: true}}
	}
	return res
}

func instance(state provisionerv1.InstanceState, ip string) *provisionerv1.Instance {
	return &provisionerv1.Instance{ProviderId: "vms/101/proxy-u1", State: state, Ip: ip}
}

var (
	runningInst = instance(provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, "10.0.0.9")
	noAddress   = instance(provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING, "")
	stoppedInst = instance(provisionerv1.InstanceState_INSTANCE_STATE_STOPPED, "")
	failedInst  = instance(provisionerv1.InstanceState_INSTANCE_STATE_FAILED, "")
	notFound    = errclass.New(errclass.NotFound, "gone")
	permanent   = errclass.New(errclass.Permanent, `placement.zone "x" is not in proxmox.nodes`)
	transient   = errclass.New(errclass.Transient, "timeout")
	quota       = errclass.New(errclass.QuotaExceeded, "Quota 'CPUS' exceeded")
	unsupported = errclass.New(errclass.Unsupported, "provider \"pve\" cannot change an instance's credentials in place")
)

// healthVerdict is a healthy verdict of sequence 1 (for the instance of
// withInstance).
func healthVerdict() *healthv1.HealthTransition {
	return &healthv1.HealthTransition{Sequence: 1, ProviderId: "vms/101/proxy-u1", Healthy: true}
}

// in is how long from now until t; "none" for nil.
func in(t *time.Time, now time.Time) any {
	if t == nil {
		return "none"
	}
	return t.Sub(now)
}
