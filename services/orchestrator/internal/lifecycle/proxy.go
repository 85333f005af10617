// Package lifecycle is the proxy's state machine, in one place: the Step of
// an in-flight command, every Reason, and every rule that moves a proxy —
// creation (New), a client's update (Update), deletion (RequestDelete),
// draining (Drain), a claimed proxy's next command (Machine.Decide), a
// provisioner's result (Machine.Apply), a health verdict (ApplyHealth), a
// command NATS never stored (Machine.Unsent) and the end of a change's
// trace (EndSettledTrace).
//
// Every rule changes only the Proxy it is given and returns what the caller
// must do with it (store it, release it, publish a command after commit).
// Nothing here reads or writes the database or NATS: the store persists
// proxies and decides nothing; dispatch runs the loops that call these
// rules. docs/orchestrator.md has the tables these rules implement.
package lifecycle

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Proxy is one proxy as the orchestrator keeps it: its desired state, its
// observed status, its place in the reconcile queue and its in-flight
// command. The store persists it column by column; Proto renders what a
// client sees.
type Proxy struct {
	UID         string
	Name        string
	Labels      map[string]string
	Spec        *proxyv1.ProxySpec
	SpecHash    string
	SkipCleanup bool
	Generation  int64
	Revision    int64
	CreateTime  time.Time
	UpdateTime  time.Time
	DeleteTime  *time.Time

	Phase                proxyv1.ProxyPhase
	ProviderID           string
	IP                   string
	Port                 uint32
	Healthy              bool
	Reason               Reason
	Message              string
	InstanceSpecHash     string
	FailedSpecHash       string
	ObservedGeneration   int64
	PhaseTransitionTime  *time.Time
	HealthTransitionTime *time.Time
	ProbeLatency         time.Duration
	HealthSequence       int64
	// StoppedSince is when the instance was first seen stopped; nil while
	// it is not.
	StoppedSince *time.Time
	// TraceParent is the W3C traceparent of the API call whose change the
	// reconciler is working on; empty once the proxy settled.
	TraceParent string

	NextAttemptTime  *time.Time
	Attempts         int32
	CommandID        string
	CommandStep      Step
	CommandSpecHash  string
	CommandDeadline  *time.Time
	CommandIssueTime *time.Time

	// Pool is the name of the pool that owns the proxy; empty for none.
	Pool string
	// DrainTime is when draining began; nil while the proxy is not
	// draining. DrainDeadline is when it is deleted regardless of leases.
	DrainTime     *time.Time
	DrainDeadline *time.Time

	// Credentials are the proxy's current credentials; nil for none.
	Credentials *Credentials
	// CredentialsStale means the instance (or the Create in flight) has
	// older credentials than Credentials: the next decision changes them.
	CredentialsStale bool
}

// Deleting reports whether deletion was requested.
func (p *Proxy) Deleting() bool { return p.DeleteTime != nil }

// Draining reports whether the proxy drains.
func (p *Proxy) Draining() bool { return p.DrainTime != nil }

// String names a proxy in logs and errors.
func (p *Proxy) String() string { return fmt.Sprintf("%s (%s)", p.Name, p.UID) }

// setPhase moves p to phase, stamping the transition time when it changes.
func (p *Proxy) setPhase(phase proxyv1.ProxyPhase, now time.Time) {
	if p.Phase != phase {
		p.Phase = phase
		p.PhaseTransitionTime = &now
	}
}

// Etag is the etag of a proxy (or pool) at revision rev.
func Etag(rev int64) string { return fmt.Sprintf("r%d", rev) }

// Proto renders the proxy as the API's Proxy. withCloudInit false leaves
// the secret cloud-init out (events, watch, the BASIC view).
func (p *Proxy) Proto(withCloudInit bool) *proxyv1.Proxy {
	spec := proto.Clone(p.Spec).(*proxyv1.ProxySpec)
	if !withCloudInit {
		spec.CloudInit = ""
	}
	return &proxyv1.Proxy{
		Uid:           p.UID,
		Name:          p.Name,
		Labels:        p.Labels,
		CreateTime:    ts(&p.CreateTime),
		UpdateTime:    ts(&p.UpdateTime),
		DeleteTime:    ts(p.DeleteTime),
		Generation:    p.Generation,
		Etag:          Etag(p.Revision),
		Revision:      p.Revision,
		SkipCleanup:   p.SkipCleanup,
		Spec:          spec,
		Draining:      p.DrainTime != nil,
		DrainTime:     ts(p.DrainTime),
		DrainDeadline: ts(p.DrainDeadline),
		Pool:          p.Pool,
		Status: &proxyv1.ProxyStatus{
			Phase:                p.Phase,
			ProviderId:           p.ProviderID,
			Ip:                   p.IP,
			Port:                 p.Port,
			Healthy:              p.Healthy,
			Reason:               string(p.Reason),
			Message:              p.Message,
			SpecHash:             p.InstanceSpecHash,
			ObservedGeneration:   p.ObservedGeneration,
			PhaseTransitionTime:  ts(p.PhaseTransitionTime),
			HealthTransitionTime: ts(p.HealthTransitionTime),
			ProbeLatency:         duration(p.ProbeLatency),
			CredentialsTime:      p.credentialsTime(),
		},
	}
}

// credentialsTime is when p's credentials were made; nil without any.
func (p *Proxy) credentialsTime() *timestamppb.Timestamp {
	if p.Credentials == nil {
		return nil
	}
	return ts(&p.Credentials.Time)
}

func ts(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}

func duration(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}

func at(t time.Time) *time.Time { return &t }
